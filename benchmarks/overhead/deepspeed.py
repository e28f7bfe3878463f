"""Step time of DeepSpeed training with GNMR on vs the same backend with GNMR off.

    python -m benchmarks.overhead.deepspeed [--backend act_quant] [--stage 2] [--steps 30]

One process (world size 1, gloo) holds two engines built from the same small Llama: one through
``gnmr_dist.deepspeed.initialize`` with a ``"gnmr"`` block, one through plain
``deepspeed.initialize`` with the same backend wrapped on the same units and an empty plan (every
unit on the low-cost path). Their steps are interleaved so machine noise hits both alike; the
medians and their ratio are printed. With GNMR on, the extra work per step is the monitor (one
fused read of every gradient), the controller, and whatever recovery the plan asks for.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from benchmarks.harness.common import arg_parser, deepspeed_world, hf_loss, llama, start_cli

logger = logging.getLogger(__name__)

VOCAB, SEQ, BATCH = 1024, 256, 4
WARM = 5
"""Untimed steps first."""


def small_llama(seed: int = 0) -> torch.nn.Module:
    """A Llama of 4 layers x 256 (FFN 688) on a 1024-token vocabulary."""
    return llama(
        vocab=VOCAB, hidden=256, ffn=688, layers=4, heads=4, seed=seed, max_position_embeddings=SEQ
    )


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def build(backend_name: str, stage: int) -> tuple[object, object]:
    """(GNMR's engine, the plain engine with the backend's low-cost path on every unit)."""
    import deepspeed

    import gnmr_dist.deepspeed as gds
    from gnmr_dist.backends import get_backend
    from gnmr_dist.distributed import UnitRegistry

    gnmr = {"backend": backend_name, "max_active": 2, "warmup_steps": 5}
    on, *_ = gds.initialize(model=small_llama(), config={**config(stage), "gnmr": gnmr})
    plain = small_llama()
    backend = get_backend(backend_name)
    backend.wrap(UnitRegistry.from_model(plain).local_modules)
    backend.apply((), step=1)
    off, *_ = deepspeed.initialize(model=plain, config=config(stage))
    return on, off


def timed_step(engine: object, tokens: torch.Tensor) -> float:
    """Wall seconds of forward, backward and optimizer step."""
    t0 = time.perf_counter()
    loss = hf_loss(engine, tokens)
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def interleaved_times(on: object, off: object, steps: int) -> dict[str, list[float]]:
    """Step times of both engines on the same batches, one step of each in turn."""
    times: dict[str, list[float]] = {"gnmr on": [], "gnmr off": []}
    for step in range(steps + WARM):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        for name, engine in (("gnmr on", on), ("gnmr off", off)):
            dt = timed_step(engine, tokens)
            if step >= WARM:
                times[name].append(dt)
    return times


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--backend", default="act_quant")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    start_cli()
    with deepspeed_world():
        on, off = build(args.backend, args.stage)
        times = interleaved_times(on, off, args.steps)
        med = {k: statistics.median(v) for k, v in times.items()}
        logger.info(
            f"backend {args.backend}, ZeRO stage {args.stage}, {args.steps} steps each, interleaved"
        )
        for name, m in med.items():
            logger.info(f"{name:>9}: median step {m * 1e3:8.1f} ms")
        logger.info(
            f"ratio gnmr on / off = {med['gnmr on'] / med['gnmr off']:.3f}  (target <= 1.03)"
        )
        tele = on.gnmr.telemetry()  # type: ignore[attr-defined]
        decisions = on.gnmr.controller.step_count  # type: ignore[attr-defined]
        logger.info(f"gnmr: {decisions} decisions, last active {tele.get('num_active')}")


if __name__ == "__main__":
    main()
