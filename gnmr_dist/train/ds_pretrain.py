"""``gnmr-ds-pretrain``: GNMR-controlled Llama training with DeepSpeed (the ``make demo`` job).

    torchrun --nproc_per_node 2 -m gnmr_dist.cli.ds_pretrain \\
        --config configs/demo_deepspeed.hjson --data embedded --run-dir runs/demo --steps 150

(or ``launch/torchrun.sh configs/demo_deepspeed.hjson --steps 150``). Builds a
``LlamaForCausalLM`` from a config (no download) or loads one from a LOCAL Hugging Face directory
(``--init-from``), optionally adds peft LoRA adapters (``--lora-rank``: the paper's fine-tuning
setting), reads fixed-length samples from ``--data`` (``gnmr_dist.data.make_dataset``: by default
the Python standard library's own sources, split into train and held-out parts), and trains it
through ``gnmr_dist.deepspeed.initialize`` with the config's ``"gnmr"`` block.

Config. The DeepSpeed JSON/HJSON file may hold, next to ``"gnmr"``, a ``"pretrain"`` block whose
keys are this command's options (``{"layers": 8, "hidden": 512, "steps": 10000}``); the command
line overrides them. DeepSpeed never sees either block.

Data order. Rank r takes the samples ``(k * world + r) * micro + i`` for micro-step ``k =
step * accumulation + a`` (``step`` 0-based), so every layout sees the same data in the same
order and a resumed run reads what the uninterrupted one would have read.

Checkpoints and restarts. ``RUN_DIR/checkpoint/`` is written every ``--save-interval`` steps and
at the end (DeepSpeed's files plus ``gnmr_state.pt``). A run whose ``RUN_DIR/checkpoint/latest``
exists resumes from it (unless ``--no-resume``): model, optimizer, step, controller and trace
(records after the checkpoint are dropped), so a job restarted by ``torchrun --max-restarts`` or
a Slurm requeue continues where it was. ``--fail-at STEP`` kills one worker with SIGKILL before
step STEP on a job's first attempt only (fault-injection for restart tests).

At the end rank 0 evaluates the held-out loss, saves the model (``hf_model/``), draws the report
and prints a summary (the run folder: docs/deepspeed.md, "gnmr-ds-pretrain").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gnmr_dist.core.validation import did_you_mean
from gnmr_dist.integrations.config import GNMRBlock, check_block_name, read_block
from gnmr_dist.train.common import import_modules, next_token_loss, setup_logging

logger = logging.getLogger(__name__)

PRETRAIN_BLOCK = "pretrain"
"""Top-level key of the DeepSpeed config holding defaults for this command's options."""

_NOT_IN_BLOCK = ("config", "help")
_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gnmr-ds-pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="DeepSpeed JSON/HJSON config with 'gnmr'")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    g.add_argument("--ffn", type=int, default=None, help="MLP width (default: 8/3 x hidden)")
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's")
    g.add_argument("--init-from", metavar="DIR", help="LOCAL Hugging Face model dir to start from")
    g.add_argument("--lora-rank", type=int, default=0, help="> 0: train peft LoRA adapters only")
    g.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x rank")
    g.add_argument("--lora-targets", default=_LORA_TARGETS, help="comma-separated module names")
    g = p.add_argument_group("data")
    g.add_argument("--data", default="embedded", help="dataset spec (gnmr_dist.data)")
    g.add_argument("--heldout", default="embedded:heldout", help="held-out dataset spec")
    g.add_argument("--tokenizer", metavar="DIR", help="LOCAL Hugging Face tokenizer dir (bytes)")
    g.add_argument("--max-bytes", type=int, default=8_000_000, help="cap on the embedded corpus")
    g.add_argument("--heldout-batches", type=int, default=8)
    g = p.add_argument_group("run")
    g.add_argument("--run-dir", default="runs/demo", help="trace, report, checkpoint go here")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--save-interval",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint every N steps (0: only at the end)",
    )
    g.add_argument("--no-resume", action="store_true", help="ignore RUN_DIR/checkpoint")
    g.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE before reading the config (it registers a backend of your own); "
        "repeatable",
    )
    g.add_argument(
        "--observe",
        action="store_true",
        help='a config without a "gnmr" block: record the norms with the default policy and '
        "no backend (without this flag such a config is refused)",
    )
    g.add_argument(
        "--fail-at",
        type=int,
        default=None,
        metavar="STEP",
        help="fault injection: the last rank dies before STEP on the first attempt",
    )
    g.add_argument("--title", default="gnmr-ds-pretrain", help="report title")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(
    argv: Sequence[str] | None = None, world_size: int | None = None, check_host: bool = True
) -> Any:
    """Options with the config's ``"pretrain"`` block as defaults, all checked before any start.

    ``world_size`` (default: ``WORLD_SIZE`` from the environment) is checked against the
    config's batch sizes; ``check_host=False`` skips what depends on this machine (a backend's
    package or GPU). A user error exits with status 2 and a message naming the fix.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        import_modules(args.imports, "--import")
        config = _read_config(args.config)
        parser.set_defaults(**pretrain_defaults(config, parser, args.config))
        args = parser.parse_args(argv)
        world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        args.gnmr_block = _validate(args, config, world, check_host)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    args.ds_config = config
    return args


def _read_config(path: str) -> dict[str, Any]:
    from gnmr_dist.integrations.deepspeed import load_ds_config

    try:
        return load_ds_config(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"--config {path} does not exist (see configs/ for the shipped ones)"
        ) from None
    except Exception as err:  # hjson's own error types
        raise ValueError(f"--config {path}: not valid JSON or HJSON ({err})") from None


def pretrain_defaults(
    config: Mapping[str, Any], parser: argparse.ArgumentParser, where: str
) -> dict[str, Any]:
    """The config's ``"pretrain"`` block as parser defaults; unknown keys name the closest."""
    block = config.get(PRETRAIN_BLOCK) or {}
    if not isinstance(block, Mapping):
        raise ValueError(f"{where}: '{PRETRAIN_BLOCK}' must be an object of option defaults")
    known = {a.dest for a in parser._actions if a.dest not in _NOT_IN_BLOCK}
    for key in block:
        if key.replace("-", "_") not in known:
            hint = did_you_mean(key.replace("-", "_"), sorted(known), cutoff=0.6)
            raise ValueError(f"{where}: unknown key '{PRETRAIN_BLOCK}.{key}'{hint}")
    return {k.replace("-", "_"): v for k, v in block.items()}


def _validate(
    args: argparse.Namespace, config: Mapping[str, Any], world: int, check_host: bool = True
) -> GNMRBlock:
    """Every option and the config, before any process group: the parsed ``"gnmr"`` block."""
    for name in ("layers", "hidden", "heads", "seq_len", "steps", "heldout_batches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    if args.heads % (args.kv_heads or args.heads):
        raise ValueError(f"--heads ({args.heads}) must be divisible by --kv-heads")
    if args.save_interval < 0 or args.lora_rank < 0:
        raise ValueError("--save-interval and --lora-rank must be >= 0")
    if args.init_from is not None and not Path(args.init_from, "config.json").is_file():
        raise FileNotFoundError(
            f"--init-from {args.init_from}: no config.json there; give a local directory "
            "written by save_pretrained (nothing is downloaded)"
        )
    if args.lora_rank > 0 and args.init_from is None:
        raise ValueError(
            "--lora-rank fine-tunes a pretrained model: give --init-from DIR (a local Hugging "
            "Face directory, e.g. a previous run's RUN_DIR/hf_model)"
        )
    check_block_name(config, str(args.config))
    _check_observe(config, args)
    gnmr = _check_gnmr(config.get("gnmr", {}), f"{args.config}: gnmr", args.run_dir, check_host)
    refuse_auto(config, args.config)
    check_batch(config, world)
    check_monitors(config)
    if check_host:
        note_cpu_optimizer_build(config)
    return gnmr


def auto_keys(config: Any, prefix: str = "") -> list[str]:
    """The dotted keys of ``config`` whose value is ``"auto"``."""
    if not isinstance(config, Mapping):
        return []
    found = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, str) and value == "auto":
            found.append(path)
        found += auto_keys(value, path + ".")
    return found


def refuse_auto(config: Mapping[str, Any], where: str) -> None:
    """A Hugging Face Trainer config (``"auto"`` values, which Trainer fills from its
    ``TrainingArguments``) cannot run here: refused, naming the keys and the two ways out."""
    keys = auto_keys(config)
    if keys:
        shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        raise ValueError(
            f'{where}: "auto" values ({shown}) are Hugging Face Trainer\'s placeholders, '
            "filled from its TrainingArguments when Trainer builds the engine; gnmr-ds-pretrain "
            "(what gnmr-launch runs) reads numbers from the config. Set them, or train this "
            'config under Trainer (its "gnmr" block is valid as checked above)'
        )


def check_monitors(config: Mapping[str, Any]) -> None:
    """DeepSpeed's tensorboard / wandb monitors need their packages: say so before starting."""
    import importlib.util

    for block, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        enabled = (config.get(block) or {}).get("enabled", False)
        if enabled and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"the config enables DeepSpeed's {block} monitor but {package} is not installed: "
                f"pip install {package}, or use csv_monitor, or set {block}.enabled to false"
            )


def note_cpu_optimizer_build(config: Mapping[str, Any]) -> None:
    """On a host without CUDA, say that DeepSpeed compiles its fused Adam for ``"type":
    "Adam"/"AdamW"`` before the first step (1-2 minutes, then cached), and how to skip it: the
    wait was silent (issue 33: the shipped NVFP4 config on a CPU)."""
    optimizer = config.get("optimizer") or {}
    kind = str(optimizer.get("type", "")).lower()
    params = optimizer.get("params") or {}
    if torch.cuda.is_available() or kind not in ("adam", "adamw") or params.get("torch_adam"):
        return
    logger.warning(
        "optimizer.type %r: on this CPU host DeepSpeed compiles its fused Adam op before the "
        "first step (1-2 minutes, then cached under TORCH_EXTENSIONS_DIR); set "
        '"optimizer.params.torch_adam": true to use torch\'s AdamW instead',
        optimizer.get("type"),
    )


def _check_observe(config: Mapping[str, Any], args: argparse.Namespace) -> None:
    """A config without a ``"gnmr"`` block runs only with ``--observe`` (and that flag only
    without one): a GNMR program silently observing is the silent corner issue 33 closes."""
    if "gnmr" not in config and not args.observe:
        raise ValueError(
            f'{args.config}: no "gnmr" block, so this run has no GNMR settings; add one (e.g. '
            '"gnmr": {"backend": "act_quant", "max_active": 2}), set "gnmr": null to train plain '
            "DeepSpeed, or pass --observe to record the norms with the default policy"
        )
    if "gnmr" in config and args.observe:
        raise ValueError(
            f'--observe is for a config without a "gnmr" block, and {args.config} has one; '
            'drop --observe, or set "backend": null in the block to observe with its policy'
        )


def _check_gnmr(block: Any, path: str, run_dir: str, check_host: bool = True) -> GNMRBlock:
    """The ``"gnmr"`` block as ``initialize`` will run it, read once: parsed as given (an absent
    block is ``{}``: GNMR observes; ``null`` or ``"enabled": false``: plain DeepSpeed), its
    ``log.trace`` then set to ``RUN_DIR/trace.jsonl`` (where the report reads it), and the
    backend's option blocks checked by building it (``initialize`` builds the run's own).

    A backend this host cannot load (``te_fp8`` without CUDA) is an error only when
    ``check_host``: its options are parsed before the import fails.
    """
    parsed = GNMRBlock.of(block, path=path)
    if parsed.enabled and parsed.probe is not None:
        raise ValueError(
            f"{path}.probe: gnmr-ds-pretrain computes its next-token loss outside the model's "
            "forward, and the probe differentiates the loss the forward returns; use the probe "
            "from your own DeepSpeed script with a forward that returns the loss (a Hugging Face "
            f"model given labels=), or drop {path}.probe"
        )
    log = dataclasses.replace(parsed.log, trace=str(Path(run_dir, "trace.jsonl")))
    checked, _ = read_block(dataclasses.replace(parsed, log=log), path, check_host=check_host)
    return checked


def check_batch(config: Mapping[str, Any], world: int) -> None:
    """DeepSpeed's batch identity ``train_batch_size = micro x accumulation x world``, early."""
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps", 1)
    total = config.get("train_batch_size")
    if micro is None:
        if total is None:
            raise ValueError("the DeepSpeed config needs train_micro_batch_size_per_gpu")
        if total % (accum * world):
            raise ValueError(
                f"train_batch_size ({total}) must be divisible by gradient_accumulation_steps x "
                f"world size ({accum} x {world}); change it or the number of processes"
            )
    elif total is not None and total != micro * accum * world:
        raise ValueError(
            f"train_batch_size ({total}) != train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x world size ({micro} x {accum} x {world} = "
            f"{micro * accum * world}); drop train_batch_size or fix the numbers"
        )


# ====================================================================== model and data


def build_model(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    """A fresh Llama from the shape options, or ``--init-from``; LoRA adapters if asked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.init_from is not None:
        model = LlamaForCausalLM.from_pretrained(args.init_from, local_files_only=True)
    else:
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=args.hidden,
            intermediate_size=args.ffn or args.hidden * 8 // 3,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads or args.heads,
            max_position_embeddings=args.seq_len,
        )
        model = LlamaForCausalLM(cfg)
    if args.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=args.lora_rank,
            lora_alpha=args.lora_alpha or 2 * args.lora_rank,
            lora_dropout=0.0,
            target_modules=[t.strip() for t in args.lora_targets.split(",") if t.strip()],
        )
        return get_peft_model(model, lora)
    return model


def model_line(model: nn.Module, trainable: Sequence[torch.Tensor]) -> str:
    """What was trained, as the summary and the report's title say it: ``Llama 2 x 64, 0.3M
    parameters`` (plus the trainable ones under LoRA). The title of a config names no size:
    its shape options may be overridden, and this line is read off the model built."""
    c: Any = model.config
    total = sum(p.numel() for p in model.parameters())
    line = f"Llama {c.num_hidden_layers} x {c.hidden_size}, {total / 1e6:.1f}M parameters"
    if sum(p.numel() for p in trainable) < total:
        line += f", {sum(p.numel() for p in trainable) / 1e6:.2f}M trained"
    return line


def batch(data: Any, step: int, rank: int, world: int, micro: int) -> torch.Tensor:
    start = (step * world + rank) * micro
    return torch.stack([data[(start + i) % len(data)] for i in range(micro)])


def heldout_loss(engine: Any, data: Any, micro: int, batches: int = 8) -> float:
    engine.eval()
    losses = []
    with torch.no_grad():
        for b in range(min(batches, max(1, len(data) // micro))):
            tokens = batch(data, b, 0, 1, micro).to(engine.device)
            losses.append(float(next_token_loss(engine, tokens)))
    engine.train()
    return sum(losses) / len(losses)


# ====================================================================== training


def train(args: argparse.Namespace) -> dict[str, Any]:
    import gnmr_dist.deepspeed as gds
    from gnmr_dist.data import ByteTokenizer, load_tokenizer, make_dataset

    if not torch.cuda.is_available():  # the CPU shm op serves inference all-reduce only
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    run = Path(args.run_dir)
    config = {k: v for k, v in args.ds_config.items() if k not in (PRETRAIN_BLOCK, "gnmr")}
    config["gnmr"] = args.gnmr_block  # parsed and checked by parse_args, not parsed again
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    data = make_dataset(args.data, args.seq_len, tok, max_bytes=args.max_bytes)
    model = build_model(args, args.vocab_size or tok.vocab_size)
    trainable = [p for p in model.parameters() if p.requires_grad]
    args.model_line = model_line(model, trainable)
    engine, *_ = gds.initialize(model=model, model_parameters=trainable, config=config)
    start = _resume(engine, run / "checkpoint", args.no_resume)
    gnmr = getattr(engine, "gnmr", None)  # None when the block says enabled: false
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    losses, t0 = [], time.perf_counter()
    for step in _progress(range(start, args.steps), rank == 0 and not args.no_progress):
        _maybe_fail(args.fail_at, step + 1, rank, world)
        accum = engine.gradient_accumulation_steps()
        for a in range(accum):
            tokens = batch(data, step * accum + a, rank, world, micro).to(engine.device)
            loss = next_token_loss(engine, tokens)
            engine.backward(loss)
            if gnmr is not None and engine.is_gradient_accumulation_boundary():
                gnmr.note(loss=float(loss.detach()))
            engine.step()
        losses.append(float(loss.detach()))
        if args.save_interval and (step + 1) % args.save_interval == 0 and step + 1 < args.steps:
            engine.save_checkpoint(str(run / "checkpoint"))
    elapsed = time.perf_counter() - t0
    if start < args.steps or not (run / "checkpoint" / "latest").is_file():
        engine.save_checkpoint(str(run / "checkpoint"))
    held_data = make_dataset(args.heldout, args.seq_len, tok, max_bytes=args.max_bytes)
    held = heldout_loss(engine, held_data, micro, args.heldout_batches)
    _export(engine, run / "hf_model", config)
    return _summary(engine, args, losses, held, elapsed, world, start)


def _resume(engine: Any, ckpt: Path, disabled: bool) -> int:
    """Load ``ckpt`` when it holds a checkpoint; the number of steps already done."""
    if disabled or not (ckpt / "latest").is_file():
        return 0
    path, _ = engine.load_checkpoint(str(ckpt))
    if path is None:
        raise RuntimeError(f"{ckpt}: 'latest' exists but DeepSpeed loaded nothing")
    logger.info("resumed from %s at step %d", path, engine.global_steps)
    return int(engine.global_steps)


def _maybe_fail(fail_at: int | None, step: int, rank: int, world: int) -> None:
    """Fault injection: the last rank kills itself before ``step`` on a job's first attempt."""
    if fail_at is None:
        return  # the drill is test apparatus, loaded only when --fail-at asks for it
    from gnmr_dist.testing.drills import restart_drill

    restart_drill("--fail-at", fail_at, step, rank, world)


def _export(engine: Any, out: Path, config: Mapping[str, Any]) -> None:
    """Rank 0 writes the trained model (or LoRA adapter) with ``save_pretrained``."""
    if (config.get("zero_optimization") or {}).get("stage", 0) >= 3:
        logger.info("ZeRO-3: hf_model/ not written (use DeepSpeed's zero_to_fp32 on checkpoint/)")
    elif dist.get_rank() == 0:
        engine.module.save_pretrained(str(out))
    dist.barrier()


def _progress(steps: range, show: bool) -> Any:
    if not show:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc="gnmr", unit="step", file=sys.stderr)


def _summary(
    engine: Any,
    args: argparse.Namespace,
    losses: list[float],
    held: float,
    elapsed: float,
    world: int,
    start: int,
) -> dict[str, Any]:
    gnmr = getattr(engine, "gnmr", None)
    tele = gnmr.telemetry() if gnmr is not None else {"skipped_steps": engine.skipped_steps}
    tail = losses[-10:] or [math.nan]
    return {
        "steps": args.steps,
        "resumed_from": start,
        "world_size": world,
        "first_loss": losses[0] if losses else math.nan,
        "last_loss": sum(tail) / len(tail),
        "heldout_loss": held,
        "heldout_ppl": math.exp(min(held, 700.0)),
        "seconds": elapsed,
        "decisions": gnmr.controller.step_count if gnmr is not None else 0,
        "skipped_steps": tele["skipped_steps"],
        "backend": gnmr.block.backend if gnmr is not None else "off",
        "warmup_steps": gnmr.runtime.controller.config.warmup_steps if gnmr is not None else 0,
        "units": gnmr.registry.num_units if gnmr is not None else 0,
        "model": args.model_line,
        **_accounting(gnmr),
    }


def _accounting(gnmr: Any) -> dict[str, Any]:
    """The run's accounting (docs/telemetry.md#accounting) as the summary's ``accounting`` and
    the lines printed at the end (``accounting_lines``); nothing without GNMR."""
    if gnmr is None:
        return {}
    return {
        "accounting": gnmr.summary().as_dict(gnmr.registry.names),
        "accounting_lines": gnmr.summary_lines(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging(int(os.environ.get("RANK", "0")))  # first: the backend is built in parse_args
    args = parse_args(argv)
    summary = train(args)
    if dist.get_rank() == 0:
        _finish(Path(args.run_dir), summary, args.title)
    from gnmr_dist.distributed.teardown import close_distributed

    close_distributed()  # barrier, groups destroyed, gloo's workers idle before the exit
    return 0


def rates_line(summary: Mapping[str, Any]) -> str:
    """The summary's line on exceedances and recovery, counted after the warm-up; a run that
    never left its warm-up has no such figures, and says so instead of printing 0%."""
    warmup, skipped = summary["warmup_steps"], f"{summary['skipped_steps']:.0f} skipped steps"
    if summary["steps"] <= warmup or summary["exceedance_rate"] is None:
        return (
            f"  no exceedance or recovery figures: all {summary['steps']} steps were within the "
            f"{warmup} warm-up steps (gnmr.warmup_steps), when GNMR only learns the norms; "
            f"{skipped}"
        )
    counted = f" after the {warmup} warm-up steps" if warmup else ""
    return (
        f"  exceedances {100 * summary['exceedance_rate']:.3f}% and recovery "
        f"{100 * summary['recovery_rate']:.3f}% of the eligible unit-steps{counted}; {skipped}"
    )


def _finish(run: Path, summary: dict[str, Any], title: str) -> None:
    from gnmr_dist.telemetry.report import draw_report

    if (run / "trace.jsonl").is_file():
        try:
            figure_title = f"{title} ({summary['model']})"
            report = draw_report(run / "trace.jsonl", run / "report.png", title=figure_title)
        except (ValueError, ImportError) as err:  # the run trained and saved: say so, go on
            logger.error(
                "gnmr: report.png not drawn (%s); the checkpoint and summary.json are written, "
                "and `gnmr-report %s` draws it once the cause is fixed",
                err,
                run,
            )
        else:
            summary.update(
                exceedance_rate=report["exceedance_rate"], recovery_rate=report["recovery_rate"]
            )
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    resumed = f", resumed at step {summary['resumed_from']}" if summary["resumed_from"] else ""
    print(
        f"\n{title}: {summary['steps']} steps on {summary['world_size']} processes "
        f"({summary['backend']} backend, {summary['units']} units) in "
        f"{summary['seconds']:.0f} s{resumed}\n  model: {summary['model']}"
    )
    print(
        f"  train loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}; held-out "
        f"loss {summary['heldout_loss']:.3f} (perplexity {summary['heldout_ppl']:.1f})"
    )
    if "exceedance_rate" in summary:
        print(rates_line(summary))
    for line in summary.get("accounting_lines", ()):
        print(f"  {line.removeprefix('gnmr: ')}")
    print(f"  run folder: {run}/ (trace.jsonl, report.png, summary.json, checkpoint/, hf_model/)")
