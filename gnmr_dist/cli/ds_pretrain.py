"""``gnmr-ds-pretrain``: GNMR-controlled Llama pretraining with DeepSpeed (the ``make demo`` job).

    torchrun --nproc_per_node 2 -m gnmr_dist.cli.ds_pretrain \\
        --config configs/demo_deepspeed.hjson --data embedded --run-dir runs/demo --steps 150

Builds a small ``LlamaForCausalLM`` from a config (no download), reads fixed-length samples from
``--data`` (``gnmr_dist.data.make_dataset``: by default the Python standard library's own sources,
split into train and held-out parts), and trains it through ``gnmr_dist.deepspeed.initialize``
with the config's ``"gnmr"`` block. Rank r takes the samples ``(step * world + r) * micro + i``,
so every layout sees the same data in the same order. At the end rank 0 evaluates the held-out
loss, saves a DeepSpeed checkpoint (with the GNMR state), draws the report and prints a summary.
The run folder holds ``trace.jsonl``, ``report.png``, ``summary.json`` and ``checkpoint/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("gnmr_dist.ds_pretrain")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gnmr-ds-pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", required=True, help="DeepSpeed JSON/HJSON config with a 'gnmr' block"
    )
    p.add_argument("--data", default="embedded", help="dataset spec (gnmr_dist.data)")
    p.add_argument("--heldout", default="embedded:heldout", help="held-out dataset spec")
    p.add_argument("--run-dir", default="runs/demo", help="where trace, report and checkpoint go")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="cap on the embedded corpus")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def llama(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def batch(data: Any, step: int, rank: int, world: int, micro: int) -> torch.Tensor:
    start = (step * world + rank) * micro
    return torch.stack([data[(start + i) % len(data)] for i in range(micro)])


def heldout_loss(engine: Any, data: Any, micro: int, batches: int = 8) -> float:
    engine.eval()
    losses = []
    with torch.no_grad():
        for b in range(min(batches, max(1, len(data) // micro))):
            tokens = batch(data, b, 0, 1, micro)
            losses.append(float(engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss))
    engine.train()
    return sum(losses) / len(losses)


def train(args: argparse.Namespace) -> dict[str, Any]:
    import gnmr_dist.deepspeed as gds
    from gnmr_dist.data import ByteTokenizer, make_dataset
    from gnmr_dist.deepspeed import load_ds_config

    if not torch.cuda.is_available():  # the CPU shm op serves inference all-reduce only
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    run = Path(args.run_dir)
    config = load_ds_config(args.config)
    config.setdefault("gnmr", {}).setdefault("log", {})["trace"] = str(run / "trace.jsonl")
    tok = ByteTokenizer()
    data = make_dataset(args.data, args.seq_len, max_bytes=args.max_bytes)
    engine, *_ = gds.initialize(model=llama(args, tok.vocab_size), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    losses, t0 = [], time.perf_counter()
    for step in _progress(range(args.steps), rank == 0 and not args.no_progress):
        tokens = batch(data, step, rank, world, micro)
        loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        engine.backward(loss)
        engine.gnmr.note(loss=float(loss.detach()))
        engine.step()
        losses.append(float(loss.detach()))
    elapsed = time.perf_counter() - t0
    engine.save_checkpoint(str(run / "checkpoint"))
    held = heldout_loss(engine, make_dataset(args.heldout, args.seq_len), micro)
    return _summary(engine, losses, held, elapsed, world)


def _progress(steps: range, show: bool) -> Any:
    if not show:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc="gnmr demo", unit="step", file=sys.stderr)


def _summary(engine: Any, losses: list[float], held: float, elapsed: float, world: int) -> dict:
    tele = engine.gnmr.telemetry()
    return {
        "steps": len(losses), "world_size": world, "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]), "heldout_loss": held,
        "heldout_ppl": math.exp(held), "seconds": elapsed,
        "decisions": engine.gnmr.controller.step_count, "skipped_steps": tele["skipped_steps"],
        "backend": engine.gnmr.block.backend, "units": engine.gnmr.registry.num_units,
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.config).is_file():
        print(f"gnmr-ds-pretrain: config {args.config} does not exist", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING if rank else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    summary = train(args)
    if dist.get_rank() == 0:
        _finish(Path(args.run_dir), summary)
    dist.barrier()
    return 0


def _finish(run: Path, summary: dict[str, Any]) -> None:
    from gnmr_dist.cli.report import draw_report

    report = draw_report(run / "trace.jsonl", run / "report.png", title="make demo")
    summary.update(exceedance_rate=report["exceedance_rate"], recovery_rate=report["recovery_rate"])
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\ngnmr demo: {summary['steps']} steps on {summary['world_size']} processes "
        f"({summary['backend']} backend, {summary['units']} units) in {summary['seconds']:.0f} s"
    )
    print(
        f"  train loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}; held-out "
        f"loss {summary['heldout_loss']:.3f} (perplexity {summary['heldout_ppl']:.1f})"
    )
    print(
        f"  exceedances {100 * summary['exceedance_rate']:.3f}% and recovery "
        f"{100 * summary['recovery_rate']:.3f}% of eligible unit-steps; "
        f"{summary['skipped_steps']:.0f} skipped steps"
    )
    print(f"  run folder: {run}/ (trace.jsonl, report.png, summary.json, checkpoint/)")


if __name__ == "__main__":
    sys.exit(main())
