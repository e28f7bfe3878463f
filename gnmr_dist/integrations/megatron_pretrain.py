"""GPT pretraining on megatron-core with GNMR: the entry point launch scripts run under torchrun.

    torchrun --nproc_per_node 4 -m gnmr_dist.integrations.megatron_pretrain \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 100 --lr 1e-3 \\
        --gnmr-config gnmr.json --backend act_quant --data synthetic --save ckpt --save-interval 50

(or the ``gnmr-megatron-pretrain`` console script). What it runs, all megatron-core's own parts:
``parallel_state`` (TP x PP x DP from ``WORLD_SIZE``), a ``GPTModel`` (untied output layer, no
dropout) from a layer spec, megatron's ``DistributedDataParallel`` (fp32 grad buffers, no
overlap, no distributed optimizer), ``get_megatron_optimizer`` (Adam or SGD, constant learning
rate), ``get_forward_backward_func()`` (1F1B when PP > 1), and ``megatron_patches.apply(model,
block, optimizer=opt)``, which carries GNMR's per-unit norms in megatron's clip-norm all-reduce
and applies the controller's plan from the next iteration.

Model options, with Megatron-LM's names and meanings (``megatron/training/arguments.py``), so a
LLaMA-2-shaped Megatron-LM argument set runs unchanged:

* ``--transformer-impl local`` (the default here; Megatron-LM's is ``transformer_engine``):
  ``get_gpt_layer_local_spec(normalization=...)``, megatron-core's own modules only; the
  decoder's final norm is the same class as the layers' norms (``WrappedTorchNorm`` without
  apex, so RMSNorm is ``torch.nn.RMSNorm``). ``--transformer-impl transformer_engine``:
  ``get_gpt_layer_with_transformer_engine_spec()`` (TE's fused norm + linear layers, TE
  attention); needs CUDA and an importable ``transformer_engine``, checked at parse time.
* ``--swiglu``: ``gated_linear_unit=True, activation_func=F.silu`` (default: gelu, not gated);
  without ``--ffn-hidden-size`` the FFN size is Megatron-LM's ``int(4 * h * 2 / 3 / 64) * 64``
  (else ``4 * h``).
* ``--normalization {LayerNorm,RMSNorm}``: ``TransformerConfig.normalization`` and the spec's.
* ``--position-embedding-type {learned_absolute,rope}``, ``--rotary-base``: ``GPTModel(
  position_embedding_type=..., rotary_percent=1.0, rotary_base=...)``.
* ``--disable-bias-linear``: ``add_bias_linear=False``. ``--untie-embeddings-and-output-weights``
  is accepted and changes nothing: the output layer is always untied here.
* ``--bf16``: ``TransformerConfig(bf16=True, params_dtype=pipeline_dtype=bfloat16)``, the model
  wrapped in megatron's ``Float16Module`` before DDP (as Megatron-LM does), and
  ``OptimizerConfig(bf16=True)``: megatron's ``Float16OptimizerWithFloat16Params`` keeps fp32
  main parameters and steps on copies of the ``main_grad`` buffers, which GNMR attributes
  through the optimizer's parameter groups. Without it everything is fp32. Runs on CPU too
  (slowly): ``megatron_patches.cpu`` builds megatron's mixed-precision optimizer there.
* ``--fp8-format {e4m3,hybrid}``, ``--fp8-recipe {delayed,tensorwise,blockwise,mxfp8}``:
  ``TransformerConfig(fp8=..., fp8_recipe=...)``; need ``--transformer-impl transformer_engine``
  and ``--bf16``.

On CPU (``--cpu``, or no CUDA) every fused kernel is off (``megatron_patches.cpu``).

Layout independence. The same ``--seed`` gives the same run at every TP/PP/DP layout, up to
floating-point reduction order: every weight matrix is drawn at full size from a generator seeded
by ``(seed, global parameter name)`` and then sliced for tensor parallelism (megatron's own
initialisation depends on the pipeline layout), and every micro-batch is a function of
``(iteration, global micro-batch index)``, where DP rank ``d`` takes global micro-batches
``d * m .. d * m + m - 1`` of the ``global / micro`` in an iteration (``m`` per rank). A weight
with megatron's ``partition_stride`` s > 1 is sliced the way megatron's own CPU initialisation
does it: the full weight in ``tp * s`` chunks, TP rank ``r`` holding chunks ``r, r + tp, ...``.
With ``--swiglu`` that is ``linear_fc1`` (stride 2): the full weight is ``[gate; up]`` and each
TP rank holds ``[its gate chunk; its up chunk]``, the layout megatron's gated MLP splits in two.

Data. ``--data synthetic``: uniform random tokens from a generator seeded by ``(seed, iteration,
global micro-batch index)``. ``--data PREFIX`` where ``PREFIX.bin`` and ``PREFIX.idx`` exist: a
megatron-core indexed dataset (Megatron-LM's ``preprocess_data.py`` output), its documents
concatenated in order (read with megatron-core's ``IndexedDataset``; ``--vocab-size`` must cover
its ids). ``--data PATH_OR_GLOB``: byte-level tokens (token = byte value, so
``--vocab-size`` >= 256) of the matching files read in sorted order and concatenated, cut into
fixed samples of ``seq + 1`` tokens with stride ``seq``; iteration ``i`` reads the ``i``-th
``global-batch`` samples, wrapping around. No evaluation split: every sample is for training.

Checkpoints (``--save DIR``, ``--save-interval N``, ``--load DIR``) use megatron-core's
``dist_checkpointing`` in Megatron-LM's layout: ``DIR/iter_0000015/`` (torch_dist shards) plus
``DIR/latest_checkpointed_iteration.txt``. Sharded: the model and the optimizer state (Adam
moments, sharded like their parameters, so a checkpoint can be loaded at another TP/PP layout).
Common (``common.pt``, written by rank 0): ``iteration``, ``gnmr`` (the controller state, the
same on every rank), ``args``, and the optimizer's param groups and Adam step count. A checkpoint
without the ``gnmr`` entry is refused unless the block says ``"on_missing_state": "fresh"``.
``--load`` equal to ``--save`` with nothing saved yet starts from scratch (auto-resuming jobs).
No RNG state is saved: the model has no dropout and the data is a function of the iteration.

Fault injection. ``--inject-grad-spike ITER:LAYER[:FACTOR]`` multiplies every gradient of global
transformer layer ``LAYER`` (0-based) by ``FACTOR`` (default 100) at iteration ``ITER``, after
megatron's data-parallel reduction and before clipping: a deterministic, layout-independent
disturbance for tests and demos of GNMR's decisions.

User errors (layout, batch sizes, the GNMR config, the backend, the checkpoint to load) are
reported before any process group or model is built, with exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import logging
import math
import os
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gnmr_dist.core import Decision
from gnmr_dist.distributed.units import global_param_names
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.session import refuse_probe

__all__ = ["TRACKER_FILE", "build_parser", "main", "parse_args", "pretrain"]

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron-LM's file naming the newest checkpoint iteration in a ``--save`` directory."""

_MODEL_ARGS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
    "vocab_size", "swiglu", "normalization", "position_embedding_type", "rotary_base",
    "add_bias_linear", "bf16",
)  # fmt: skip
_LAYER = re.compile(r"^(.*?\bdecoder\.layers\.)(\d+)(\..*)$")
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")


# =============================================================================== arguments


def build_parser() -> argparse.ArgumentParser:
    """The command line, with Megatron-LM's option names where Megatron-LM has one."""
    p = argparse.ArgumentParser(
        prog="gnmr-megatron-pretrain",
        description="GPT pretraining on megatron-core with the GNMR controller (run via torchrun).",
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--vocab-size", type=int, default=256)
    g.add_argument(
        "--swiglu", action="store_true",
        help="gated SiLU MLP (default FFN size then int(4 x hidden x 2/3 / 64) x 64)",
    )  # fmt: skip
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument(
        "--position-embedding-type", choices=("learned_absolute", "rope"),
        default="learned_absolute",
    )  # fmt: skip
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (with rope)")
    g.add_argument(
        "--disable-bias-linear", action="store_false", dest="add_bias_linear",
        help="no biases in the linear layers",
    )  # fmt: skip
    g.add_argument(
        "--untie-embeddings-and-output-weights", action="store_true",
        help="accepted for Megatron-LM argument sets; a no-op: the output layer is always untied",
    )  # fmt: skip
    g = p.add_argument_group("precision and implementation")
    g.add_argument("--bf16", action="store_true", help="bf16 model, fp32 main params and grads")
    g.add_argument(
        "--transformer-impl", choices=("local", "transformer_engine"), default="local",
        help="megatron-core's own layers, or Transformer Engine's (CUDA + transformer_engine)",
    )  # fmt: skip
    g.add_argument(
        "--fp8-format", choices=("e4m3", "hybrid"), default=None, dest="fp8",
        help="FP8 training in Transformer Engine (needs --transformer-impl transformer_engine "
        "and --bf16)",
    )  # fmt: skip
    g.add_argument(
        "--fp8-recipe", choices=("delayed", "tensorwise", "blockwise", "mxfp8"),
        default="delayed", help="the FP8 scaling recipe (with --fp8-format)",
    )  # fmt: skip
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro x DP")
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=1e-3, help="constant learning rate")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--data", default="synthetic",
        help="'synthetic', a megatron indexed dataset PREFIX (.bin/.idx), or a text file glob",
    )  # fmt: skip
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, metavar="DIR")
    g.add_argument("--save-interval", type=int, default=None, metavar="N")
    g.add_argument("--load", default=None, metavar="DIR")
    g = p.add_argument_group("GNMR")
    g.add_argument(
        "--gnmr-config", default=None, metavar="PATH",
        help='JSON: a "gnmr" block, or a DeepSpeed-style config holding one (default: {})',
    )  # fmt: skip
    g.add_argument("--backend", default=None, help="override the block's backend ('none': observe)")
    g.add_argument("--trace", default=None, metavar="PATH", help="sets the block's log.trace")
    g.add_argument(
        "--inject-grad-spike", action="append", default=[], type=_spike, metavar="ITER:LAYER[:F]",
        help="multiply global layer LAYER's gradients by F (100) at iteration ITER (repeatable)",
    )  # fmt: skip
    g = p.add_argument_group("runtime")
    g.add_argument("--cpu", action="store_true", help="CPU + gloo (default without CUDA)")
    g.add_argument("--log-interval", type=int, default=10)
    return p


def _spike(text: str) -> tuple[int, int, float]:
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        factor = float(parts[2]) if len(parts) == 3 else 100.0
        return int(parts[0]), int(parts[1]), factor
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ITER:LAYER or ITER:LAYER:FACTOR, got {text!r}"
        ) from None


def parse_args(
    argv: Sequence[str] | None = None, world_size: int | None = None, check_host: bool = True
) -> argparse.Namespace:
    """Parse and validate; a user error exits with status 2 before anything is built.

    ``world_size`` defaults to the process group's, else ``WORLD_SIZE`` (a launcher checking a
    job before starting it passes the size it will launch). ``check_host=False`` skips what
    depends on the machine (CUDA, Transformer Engine): for checking a GPU job's arguments on a
    login node. Adds the derived fields
    ``world_size``, ``data_parallel_size``, ``num_micro_batches``, ``gnmr`` (the effective block
    as a plain dict), ``load_dir`` and ``data_files``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _validate(args, world_size, check_host)
    except ValueError as err:
        parser.error(str(err))
    return args


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _validate(
    args: argparse.Namespace, world_size: int | None = None, check_host: bool = True
) -> None:
    """Check every user-facing constraint and fill in the derived fields."""
    _check_positive(args)
    _validate_layout(args, world_size or _world_size())
    _validate_model(args)
    if args.cpu and torch.cuda.is_available():
        raise ValueError(
            "--cpu is for hosts without CUDA (megatron_patches.cpu never runs on a GPU)"
        )
    args.cpu = args.cpu or not torch.cuda.is_available()
    _validate_precision(args, check_host)
    args.data_files = _data_files(args)
    args.gnmr = _gnmr_block(args, check_host)
    args.load_dir = _checkpoint_dir(args.load, args.save) if args.load else None
    if args.load_dir is not None:
        _check_checkpoint(args)
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save DIR")


def _check_positive(args: argparse.Namespace) -> None:
    for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
        "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size", "train_iters",
        "log_interval",
    ):  # fmt: skip
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("ffn_hidden_size", "global_batch_size", "save_interval"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def _validate_layout(args: argparse.Namespace, world: int) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    args.world_size = world
    if world % (tp * pp):
        raise ValueError(
            f"world size ({world}) must be divisible by tensor x pipeline model parallel size "
            f"({tp} x {pp} = {tp * pp})"
        )
    dp = args.data_parallel_size = world // (tp * pp)
    micro = args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = micro * dp
    if args.global_batch_size % (micro * dp):
        raise ValueError(
            f"global batch size ({args.global_batch_size}) must be divisible by micro batch size "
            f"x data-parallel size ({micro} x {dp} = {micro * dp})"
        )
    args.num_micro_batches = args.global_batch_size // (micro * dp)


def _validate_model(args: argparse.Namespace) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = _default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if args.rotary_base < 1:
        raise ValueError(f"--rotary-base must be >= 1, got {args.rotary_base}")
    checks = [
        (args.num_layers % pp, f"--num-layers ({args.num_layers}) must be divisible by the "
                               f"pipeline model parallel size ({pp})"),
        (args.hidden_size % args.num_attention_heads, f"--hidden-size ({args.hidden_size}) must "
         f"be divisible by --num-attention-heads ({args.num_attention_heads})"),
    ]  # fmt: skip
    for name in ("num_attention_heads", "ffn_hidden_size", "vocab_size"):
        value = getattr(args, name)
        message = f"--{name.replace('_', '-')} ({value}) must be divisible by TP size ({tp})"
        checks.append((value % tp, message))
    for failed, message in checks:
        if failed:
            raise ValueError(message)
    for it, layer, factor in args.inject_grad_spike:
        if not (it >= 1 and 0 <= layer < args.num_layers and math.isfinite(factor)):
            raise ValueError(
                f"--inject-grad-spike {it}:{layer}:{factor}: needs ITER >= 1, "
                f"0 <= LAYER < {args.num_layers} and a finite FACTOR"
            )


def _default_ffn_hidden_size(hidden: int, swiglu: bool) -> int:
    """Megatron-LM's default: ``4 h``, or with SwiGLU ``4 h * 2/3`` rounded down to 64."""
    if not swiglu:
        return 4 * hidden
    ffn = int((4 * hidden * 2 / 3) / 64) * 64  # Megatron-LM's rounding, verbatim
    if ffn < 1:
        raise ValueError(
            f"--swiglu with --hidden-size {hidden}: Megatron-LM's default FFN size "
            "int(4 x hidden x 2/3 / 64) x 64 is 0 below hidden 24; pass --ffn-hidden-size"
        )
    return ffn


def _validate_precision(args: argparse.Namespace, check_host: bool = True) -> None:
    """FP8 needs TE and bf16; TE needs CUDA and an importable ``transformer_engine``."""
    if args.fp8 is not None:
        if args.transformer_impl != "transformer_engine":
            raise ValueError(
                f"--fp8-format {args.fp8} runs in Transformer Engine's layers: add "
                "--transformer-impl transformer_engine (or drop --fp8-format)"
            )
        if not args.bf16:
            raise ValueError(
                f"--fp8-format {args.fp8} needs --bf16 (FP8 GEMMs in a bf16 model with fp32 "
                "main parameters, as in Megatron-LM); add --bf16"
            )
    if args.transformer_impl == "transformer_engine" and check_host:
        fix = (
            "install Transformer Engine (pip install --no-build-isolation "
            "'transformer_engine[pytorch]') on a CUDA host or use the project's docker image, "
            "or use --transformer-impl local"
        )
        if args.cpu:
            raise ValueError(
                "--transformer-impl transformer_engine needs CUDA, and this run is on the CPU "
                f"(--cpu or no CUDA device): {fix}"
            )
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as err:  # ImportError, or a broken build's OSError/RuntimeError
            raise ValueError(
                f"--transformer-impl transformer_engine: cannot import transformer_engine "
                f"({type(err).__name__}: {err}): {fix}"
            ) from None


def _data_files(args: argparse.Namespace) -> list[str]:
    args.data_indexed = False
    if args.data == "synthetic":
        return []
    if Path(args.data + ".bin").is_file() and Path(args.data + ".idx").is_file():
        args.data_indexed = True  # a megatron-core indexed dataset of token ids
        return [args.data]
    files = sorted(f for f in glob.glob(args.data, recursive=True) if os.path.isfile(f))
    if not files:
        raise ValueError(
            f"--data {args.data!r}: no such file (expected 'synthetic', a megatron indexed "
            "dataset prefix with PREFIX.bin and PREFIX.idx, or a text file glob)"
        )
    if args.vocab_size < 256:
        raise ValueError(f"--data with text files is byte-level: --vocab-size must be >= 256, "
                         f"got {args.vocab_size}")  # fmt: skip
    size = sum(os.path.getsize(f) for f in files) + len(files) - 1
    if size < args.seq_length + 1:
        raise ValueError(
            f"--data {args.data!r}: {size} bytes is less than one sample ({args.seq_length + 1})"
        )
    return files


def _gnmr_block(args: argparse.Namespace, check_host: bool = True) -> dict[str, Any]:
    """The effective ``"gnmr"`` block (file, then --backend and --trace), validated.

    Building the backend checks its option blocks first; a backend this host cannot load
    (``te_fp8`` without CUDA) is an error only when ``check_host``.
    """
    block = dict(_read_gnmr_config(args.gnmr_config)) if args.gnmr_config else {}
    if args.backend is not None:
        block["backend"] = None if args.backend.lower() in ("none", "null") else args.backend
    if args.trace is not None:
        block["log"] = {**dict(block.get("log") or {}), "trace": args.trace}
    path = f"{args.gnmr_config}: gnmr" if args.gnmr_config else "gnmr"
    parsed = GNMRBlock.from_dict(block, path=path)  # raises ValueError naming the key and the fix
    refuse_probe(parsed, "gnmr-megatron-pretrain")
    if block.get("backend") is not None and block.get("enabled", True):
        from gnmr_dist.backends import get_backend  # validates the option blocks too

        try:
            get_backend(
                block["backend"], low_cost=block.get("low_cost"), recovery=block.get("recovery")
            )
        except ImportError as err:  # the options parsed; the hardware/package is missing
            if check_host:
                raise ValueError(str(err)) from None
    return block


def _read_gnmr_config(path: str) -> Mapping[str, Any]:
    try:
        given = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"--gnmr-config {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--gnmr-config {path}: not valid JSON ({err})") from None
    if not isinstance(given, dict):
        raise ValueError(
            f"--gnmr-config {path}: expected a JSON object, got {type(given).__name__}"
        )
    if "gnmr" in given:  # a full DeepSpeed-style config
        if not isinstance(given["gnmr"], dict):
            raise ValueError(f"--gnmr-config {path}: 'gnmr' must be a JSON object")
        return given["gnmr"]  # type: ignore[no-any-return]
    return given


def _checkpoint_dir(load: str, save: str | None) -> str | None:
    """The dist_checkpointing directory ``--load`` names (its newest, or itself).

    ``--load`` equal to ``--save`` with nothing saved there yet is a first start of an
    auto-resuming job (None: train from scratch); any other path without a checkpoint is an error.
    """
    root = Path(load)
    tracker = root / TRACKER_FILE
    if save is not None and root.resolve() == Path(save).resolve() and not tracker.exists():
        logger.warning("--load %s: no checkpoint yet (same as --save): training from scratch", load)
        return None
    if tracker.is_file():
        text = tracker.read_text().strip()
        if not text.isdigit():
            raise ValueError(f"--load {load}: {TRACKER_FILE} holds {text!r}, not an iteration")
        path = root / _iter_name(int(text))
    else:
        path = root
    if not (path / "metadata.json").is_file() or not (path / "common.pt").is_file():
        raise ValueError(
            f"--load {load}: no checkpoint at {path} (expected {TRACKER_FILE} or a megatron "
            "dist_checkpointing directory with metadata.json and common.pt)"
        )
    return str(path)


def _check_checkpoint(args: argparse.Namespace) -> None:
    """The checkpoint's model shape and GNMR state fit this run (read from common.pt)."""
    common = torch.load(Path(args.load_dir, "common.pt"), map_location="cpu", weights_only=True)
    saved = common.get("args") or {}
    diff = [f"{k}: {saved[k]} -> {getattr(args, k)}" for k in _MODEL_ARGS
            if k in saved and saved[k] != getattr(args, k)]  # fmt: skip
    if diff:
        raise ValueError(f"--load {args.load}: the checkpoint's model differs ({'; '.join(diff)})")
    block = GNMRBlock.from_dict(args.gnmr)
    if block.enabled and common.get("gnmr") is None and block.on_missing_state != "fresh":
        raise ValueError(
            f"--load {args.load}: the checkpoint {args.load_dir} has no GNMR state; resuming "
            'without it would silently reset the controller. Set "on_missing_state": "fresh" in '
            "the gnmr block to start the controller fresh on purpose."
        )


def _iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# =============================================================================== data


class _Batches:
    """Deterministic micro-batches keyed by (iteration, global micro-batch index)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.seed, self.seq, self.micro = args.seed, args.seq_length, args.micro_batch_size
        self.vocab, self.global_batch, self.device = args.vocab_size, args.global_batch_size, device
        self.tokens = _read_tokens(args) if args.data_files else None
        self.positions = torch.arange(self.seq).expand(self.micro, self.seq)

    def micro_batch(self, iteration: int, index: int) -> dict[str, torch.Tensor]:
        """Tokens, labels (next tokens) and position ids of one micro-batch."""
        if self.tokens is None:
            gen = torch.Generator().manual_seed(_mix(self.seed, iteration, index))
            tokens = torch.randint(0, self.vocab, (self.micro, self.seq + 1), generator=gen)
        else:
            tokens = self._text_samples(iteration, index)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": self.positions}
        return {k: v.to(self.device) for k, v in batch.items()}

    def _text_samples(self, iteration: int, index: int) -> torch.Tensor:
        assert self.tokens is not None
        count = (self.tokens.numel() - 1) // self.seq
        first = (iteration - 1) * self.global_batch + index * self.micro
        starts = [((first + j) % count) * self.seq for j in range(self.micro)]
        return torch.stack([self.tokens[s : s + self.seq + 1] for s in starts]).long()


def _read_tokens(args: argparse.Namespace) -> torch.Tensor:
    """The training token stream: an indexed dataset's ids, or the text files' bytes."""
    if not args.data_indexed:
        return _read_bytes(args.data_files)
    from gnmr_dist.data import MegatronIndexedDataset

    tokens = MegatronIndexedDataset(args.data, args.seq_length).tokens
    top = int(tokens.max())
    if top >= args.vocab_size:
        raise ValueError(
            f"--data {args.data}: holds token id {top}, but --vocab-size is {args.vocab_size}; "
            "set --vocab-size to the tokenizer's (padded) vocabulary size"
        )
    return tokens


def _read_bytes(files: Sequence[str]) -> torch.Tensor:
    data = b"\n".join(Path(f).read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions)."""
    digest = hashlib.sha256(repr(values).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# =============================================================================== model


def _transformer_config(args: argparse.Namespace) -> Any:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    fields: dict[str, Any] = {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "ffn_hidden_size": args.ffn_hidden_size,
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "normalization": args.normalization,
        "add_bias_linear": args.add_bias_linear,
        "bf16": args.bf16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "transformer_impl": args.transformer_impl,
    }
    if args.swiglu:  # fc1 holds [gate; up] per TP rank (partition_stride 2)
        fields.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    else:  # fc1 splits contiguously over TP
        fields.update(gated_linear_unit=False, activation_func=torch.nn.functional.gelu)
    if args.fp8 is not None:
        fields.update(fp8=args.fp8, fp8_recipe=args.fp8_recipe)
    if args.cpu:
        from megatron_patches import cpu_transformer_config

        return cpu_transformer_config(**fields)
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**fields)


def _layer_spec(args: argparse.Namespace, config: Any) -> Any:
    """The decoder spec of ``--transformer-impl``: a layer spec, or (local) a block spec."""
    from megatron.core.models.gpt import gpt_layer_specs

    if args.transformer_impl == "transformer_engine":
        # TE's fused norm + linear layers read config.normalization; the block's final norm is
        # TENorm (megatron picks it when transformer_engine imports)
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = gpt_layer_specs.get_gpt_layer_local_spec(normalization=args.normalization)
    # megatron would give a bare layer spec the final norm of whatever is installed (TENorm,
    # apex's FusedLayerNorm, which has no RMSNorm, or WrappedTorchNorm): use the layers' own
    # norm class, so a local model is megatron-core modules only and RMSNorm works everywhere
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config),
        layer_norm=layer.submodules.input_layernorm,
    )


def _build_gpt(args: argparse.Namespace) -> Any:
    """This rank's pipeline stage of the GPT model, initialised layout-independently.

    With ``--bf16``, wrapped in megatron's ``Float16Module`` (bf16 parameters, fp32 outputs).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = _transformer_config(args)
    model = GPTModel(
        config,
        transformer_layer_spec=_layer_spec(args, config),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=1.0,
        rotary_base=args.rotary_base,
    )
    if not args.cpu:
        model.cuda(torch.cuda.current_device())
    _init_weights(model, args.seed, config, ps.get_tensor_model_parallel_rank())
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        return Float16Module(config, model)
    return model


def _init_weights(model: torch.nn.Module, seed: int, config: Any, tp_rank: int) -> None:
    """Redraw every weight matrix at full size from (seed, global name), keep this TP slice.

    The slice is megatron's: a tensor-parallel weight of ``partition_stride`` s is cut into
    ``tp * s`` chunks along ``partition_dim`` and TP rank ``r`` holds chunks ``r, r + tp, ...``
    (s = 1: the ``r``-th of ``tp`` chunks; SwiGLU's ``linear_fc1``, s = 2: the full weight is
    ``[gate; up]`` and rank ``r`` holds ``[gate chunk r; up chunk r]``). Vectors (biases, norm
    weights) keep megatron's constant initial values. Output projections get megatron's scaled
    std ``init_method_std / sqrt(2 * num_layers)``. Drawn in fp32, then cast to the parameter.
    """
    tp = config.tensor_model_parallel_size
    scaled = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    names = global_param_names(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            gname = names[name]
            std = scaled if gname.endswith(_OUTPUT_PROJECTIONS) else config.init_method_std
            gen = torch.Generator().manual_seed(_mix(seed, zlib.crc32(gname.encode())))
            if not getattr(param, "tensor_model_parallel", False):
                param.copy_(torch.randn(list(param.shape), generator=gen) * std)
                continue
            dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
            shape = list(param.shape)
            shape[dim] *= tp
            full = torch.randn(shape, generator=gen) * std
            param.copy_(torch.cat(torch.chunk(full, tp * stride, dim=dim)[tp_rank::tp], dim=dim))


def _wrap_ddp(model: Any) -> Any:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def _build_optimizer(args: argparse.Namespace, model: Any) -> Any:
    """megatron's optimizer: fp32 (``FP32Optimizer``) or, with ``--bf16``, fp32 main params."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad, bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=False,
    )  # fmt: skip
    return get_megatron_optimizer(cfg, [model])  # bf16 on CPU: megatron_patches.cpu


def _layer_params(model: torch.nn.Module) -> dict[int, list[torch.nn.Parameter]]:
    """This rank's parameters of each global transformer layer (0-based)."""
    layers: dict[int, list[torch.nn.Parameter]] = {}
    names = global_param_names(model)
    for name, param in model.named_parameters():
        match = _LAYER.match(names[name])
        if match is not None:
            layers.setdefault(int(match.group(2)), []).append(param)
    return layers


# =============================================================================== the run


@dataclass
class _Run:
    """Everything one training run holds."""

    args: argparse.Namespace
    model: Any
    optimizer: Any
    gnmr: Any
    batches: _Batches
    layers: dict[int, list[torch.nn.Parameter]]
    trace: Any = None
    history: dict[str, list[Any]] = field(default_factory=dict)


@contextlib.contextmanager
def _distributed(args: argparse.Namespace) -> Iterator[torch.device]:
    """Process group (if not yet there), CPU compat, megatron's parallel state; undone on exit."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_patches import cpu_compat

    created = not dist.is_initialized()
    if created:
        backend = "gloo" if args.cpu else "nccl"
        if not args.cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    with cpu_compat() if args.cpu else contextlib.nullcontext():
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            )
            tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
            yield device
        finally:
            import megatron_patches

            megatron_patches.remove()
            ps.destroy_model_parallel()
            if created:
                dist.destroy_process_group()


def _build(args: argparse.Namespace, device: torch.device) -> _Run:
    import megatron_patches

    gpt = _build_gpt(args)
    model = _wrap_ddp(gpt)
    optimizer = _build_optimizer(args, model)
    block = GNMRBlock.from_dict(args.gnmr)
    handle = None
    if block.enabled:
        handle = megatron_patches.apply(model, block, optimizer=optimizer)
    run = _Run(args, model, optimizer, handle, _Batches(args, device), _layer_params(model))
    run.history = {k: [] for k in ("iteration", "loss", "grad_norm", "step", "active", "risk")}
    return run


def pretrain(args: argparse.Namespace) -> dict[str, Any]:
    """Train as ``args`` says (from :func:`parse_args`); every rank returns the same history.

    Returns ``{"iteration", "loss", "grad_norm", "step", "active", "risk"}`` lists, one entry per
    iteration run here (loss: mean over the global batch; ``step``/``active``/``risk``: the GNMR
    decision of that iteration, ``None`` without GNMR), plus ``"units"`` (global unit names),
    ``"start_iteration"`` (0, or the loaded checkpoint's) and ``"rank"``.
    """
    with _distributed(args) as device:
        run = _build(args, device)
        start = _load_checkpoint(run) if args.load_dir else 0
        run.trace = _trace_writer(run)
        try:
            for iteration in range(start + 1, args.train_iters + 1):
                _iteration(run, iteration)
                _maybe_save(run, iteration)
        finally:
            if run.trace is not None:
                run.trace.close()
        units = list(run.gnmr.registry.names) if run.gnmr is not None else []
        return {**run.history, "units": units, "start_iteration": start, "rank": dist.get_rank()}


def _iteration(run: _Run, iteration: int) -> None:
    """Forward/backward over the micro-batches, spike injection, optimizer step, bookkeeping."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args, model = run.args, run.model
    model.zero_grad_buffer()
    run.optimizer.zero_grad()
    data = _micro_batches(run, iteration)
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=data, model=[model],
        num_microbatches=args.num_micro_batches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False,
    )  # fmt: skip
    _inject_spikes(run, iteration)
    decided = _decisions(run)
    ok, grad_norm, _ = run.optimizer.step()  # GNMR collects the step's norms inside
    if run.gnmr is not None:  # this program logs every decision: take it now, not lazily
        run.gnmr.settle()
    if not ok:
        logger.warning("iteration %d: megatron skipped the update", iteration)
    decision = run.gnmr.runtime.last_decision if _decisions(run) > decided else None
    _record(run, iteration, _global_loss(run, losses), float(grad_norm or 0.0), decision)


def _decisions(run: _Run) -> int:
    return int(run.gnmr.runtime.controller.step_count) if run.gnmr is not None else 0


def _micro_batches(run: _Run, iteration: int) -> Iterator[dict[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    m = run.args.num_micro_batches
    first = ps.get_data_parallel_rank() * m
    return iter([run.batches.micro_batch(iteration, first + i) for i in range(m)])


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: Any) -> Any:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, _loss_func


def _loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place


def _global_loss(run: _Run, losses: Sequence[Mapping[str, torch.Tensor]]) -> float:
    """Mean loss over the global batch, on every rank (one scalar all-reduce)."""
    from megatron.core import parallel_state as ps

    device = run.batches.device
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage() and losses:
        total += torch.stack([x["lm loss"].double() for x in losses]).mean()
    dist.all_reduce(total)
    last_stage_ranks = run.args.world_size // run.args.pipeline_model_parallel_size
    return float(total) / last_stage_ranks


def _inject_spikes(run: _Run, iteration: int) -> None:
    for it, layer, factor in run.args.inject_grad_spike:
        if it == iteration:
            grads = [p.main_grad for p in run.layers.get(layer, [])]
            if grads:
                torch._foreach_mul_(grads, factor)
            if dist.get_rank() == 0:
                logger.info("iteration %d: layer %d gradients x %g (injected)", it, layer, factor)


def _record(
    run: _Run, iteration: int, loss: float, grad_norm: float, decision: Decision | None
) -> None:
    fresh = decision is not None
    h = run.history
    h["iteration"].append(iteration)
    h["loss"].append(loss)
    h["grad_norm"].append(grad_norm)
    h["step"].append(decision.step if fresh else None)
    h["active"].append(tuple(decision.active) if fresh else None)
    h["risk"].append(decision.risk.clone() if fresh else None)
    if run.trace is not None and fresh:
        norms = run.gnmr.runtime.last_norms.norms
        run.trace.write(norms, decision, {"iteration": iteration, "loss": loss,
                                          "grad_norm": grad_norm})  # fmt: skip
    if dist.get_rank() == 0 and (iteration % run.args.log_interval == 0 or iteration == 1):
        names = run.gnmr.runtime.plan.names if run.gnmr is not None else ()
        logger.info("iteration %d/%d | loss %.6f | grad norm %.4f | recovery next: %d %s",
                    iteration, run.args.train_iters, loss, grad_norm, len(names),
                    list(names))  # fmt: skip


def _trace_writer(run: _Run) -> Any:
    """Rank 0's JSON-lines trace (records after a resumed checkpoint are dropped)."""
    if run.gnmr is None or run.gnmr.block.log.trace is None or dist.get_rank() != 0:
        return None
    from gnmr_dist.telemetry import TraceHeader, TraceWriter

    registry, block = run.gnmr.registry, run.gnmr.block
    header = TraceHeader(
        registry.names, tuple(registry.eligible.tolist()), block.policy,
        {"backend": block.backend, "units": block.units, "source": "megatron_pretrain"},
    )  # fmt: skip
    done = run.gnmr.runtime.controller.step_count
    return TraceWriter(block.log.trace, header, resume_after=done or None)


# =============================================================================== checkpoints


def _plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """``args`` as weights_only-safe values (the common entry ``"args"``)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}


def _sharded_state(run: _Run, is_loading: bool) -> dict[str, Any]:
    model = run.model.module  # the GPTModel: Megatron-LM's key names
    state: dict[str, Any] = {"model": model.sharded_state_dict()}
    state["optimizer"] = run.optimizer.sharded_state_dict(state["model"], is_loading=is_loading)
    return state


def _maybe_save(run: _Run, iteration: int) -> None:
    args = run.args
    if args.save is None:
        return
    due = args.save_interval is not None and iteration % args.save_interval == 0
    if due or iteration == args.train_iters:
        _save_checkpoint(run, iteration)


def _save_checkpoint(run: _Run, iteration: int) -> str:
    """Save model + optimizer (sharded) and iteration/GNMR/args (common) at ``iteration``."""
    from megatron.core import dist_checkpointing

    path = Path(run.args.save, _iter_name(iteration))
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(run, is_loading=False)
    state["iteration"] = iteration
    state["gnmr"] = run.gnmr.state_dict() if run.gnmr is not None else None
    state["args"] = _plain_args(run.args)
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        Path(run.args.save, TRACKER_FILE).write_text(str(iteration))
        logger.info("saved checkpoint %s", path)
    return str(path)


def _load_checkpoint(run: _Run) -> int:
    """Restore model, optimizer and GNMR state from ``args.load_dir``; return its iteration."""
    from megatron.core import dist_checkpointing

    path = run.args.load_dir
    state = dist_checkpointing.load(_sharded_state(run, is_loading=True), path)
    run.model.module.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    if run.gnmr is not None:
        _restore_gnmr(run, state.get("gnmr"), path)
    iteration = int(state["iteration"])
    if dist.get_rank() == 0:
        logger.info("loaded checkpoint %s (iteration %d)", path, iteration)
    return iteration


def _restore_gnmr(run: _Run, gnmr_state: Any, path: str) -> None:
    if gnmr_state is None:  # parse_args refused this unless on_missing_state is "fresh"
        if run.gnmr.block.on_missing_state != "fresh":
            raise ValueError(f"checkpoint {path} has no GNMR state")
        logger.warning("checkpoint %s has no GNMR state: controller starts fresh", path)
        return
    try:
        run.gnmr.load_state_dict(gnmr_state)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {path}: cannot restore the GNMR state: {err}") from err


# =============================================================================== CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``gnmr-megatron-pretrain``: parse, train, print a summary on rank 0."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its per-parameter INFO lists
    args = parse_args(argv)
    result = pretrain(args)
    if rank == 0 and result["loss"]:
        recovered = sum(1 for a in result["active"] if a)
        print(  # the console script's summary
            f"done: iterations {result['iteration'][0]}-{result['iteration'][-1]}, "
            f"loss {result['loss'][0]:.4f} -> {result['loss'][-1]:.4f}, "
            f"{recovered} iterations planned recovery for some unit"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
