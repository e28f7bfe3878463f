"""Step time of DeepSpeed training with GNMR on vs the same backend with GNMR off.

    python -m benchmarks.deepspeed_overhead [--backend act_quant] [--stage 2] [--steps 30]

One process (world size 1, gloo) holds two engines built from the same small Llama: one through
``gnmr_dist.deepspeed.initialize`` with a ``"gnmr"`` block, one through plain
``deepspeed.initialize`` with the same backend wrapped on the same units and an empty plan (every
unit on the low-cost path). Their steps are interleaved so machine noise hits both alike; the
medians and their ratio are printed. With GNMR on, the extra work per step is the monitor (one
fused read of every gradient), the controller, and whatever recovery the plan asks for.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def build(backend_name: str, stage: int) -> tuple[object, object]:
    import deepspeed

    import gnmr_dist.deepspeed as gds
    from gnmr_dist.backends import get_backend
    from gnmr_dist.distributed import UnitRegistry

    gnmr = {"backend": backend_name, "max_active": 2, "warmup_steps": 5}
    on, *_ = gds.initialize(model=llama(), config={**config(stage), "gnmr": gnmr})
    plain = llama()
    backend = get_backend(backend_name)
    backend.wrap(UnitRegistry.from_model(plain).local_modules)
    backend.apply((), step=1)
    off, *_ = deepspeed.initialize(model=plain, config=config(stage))
    return on, off


def timed_step(engine: object, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    loss = engine(input_ids=tokens, labels=tokens).loss  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="act_quant")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference-only op
    on, off = build(args.backend, args.stage)
    times: dict[str, list[float]] = {"gnmr on": [], "gnmr off": []}
    for step in range(args.steps + 5):
        tokens = torch.randint(0, 1024, (4, 256), generator=torch.Generator().manual_seed(step))
        for name, engine in (("gnmr on", on), ("gnmr off", off)):
            dt = timed_step(engine, tokens)
            if step >= 5:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"backend {args.backend}, ZeRO stage {args.stage}, {args.steps} steps each, interleaved")
    for name, m in med.items():
        print(f"{name:>9}: median step {m * 1e3:8.1f} ms")
    print(f"ratio gnmr on / off = {med['gnmr on'] / med['gnmr off']:.3f}  (target <= 1.03)")
    tele = on.gnmr.telemetry()  # type: ignore[attr-defined]
    print(f"gnmr: {on.gnmr.controller.step_count} decisions, last active {tele.get('num_active')}")  # type: ignore[attr-defined]
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
