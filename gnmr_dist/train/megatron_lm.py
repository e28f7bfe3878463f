"""GPT pretraining on Megatron-LM's own training loop, with GNMR: ``gnmr-megatron-pretrain``.

    torchrun --nproc_per_node 8 -m gnmr_dist.cli.megatron_pretrain \\
        <any argument set of Megatron-LM's pretrain_gpt.py> --gnmr-config gnmr.json

The program is ``pretrain_gpt.py`` with GNMR added, on ``megatron.training.pretrain`` as
shipped in megatron-core 0.17+ wheels (the version table's ``has_training``): Megatron-LM's
argument parser, data sets (``--data-path``, blends, splits, ``--mock-data``), LR schedules,
distributed optimizer, TP/SP/PP/VPP/CP, checkpointing and TensorBoard / W&B writers run
unchanged. What it adds:

* ``extra_args_provider``: ``--gnmr-config FILE`` (JSON: the ``"gnmr"`` block, or a DeepSpeed
  config holding one; without it GNMR is off and the program is plain ``pretrain_gpt.py``),
  ``--gnmr-backend NAME`` (overrides the block's; ``none``: observe only),
  ``--gnmr-trace FILE`` (the block's ``log.trace``), ``--gnmr-inject-grad-spike
  ITER:LAYER[:FACTOR]`` (repeatable: multiply every gradient of global transformer layer
  ``LAYER``, 0-based, by ``FACTOR`` (default 100) before the optimizer step of iteration
  ``ITER``, 1-based: a deterministic disturbance for tests and demos), ``--gnmr-fail-at ITER``
  (a restart drill under torchrun: on the job's first attempt, ``TORCHELASTIC_RESTART_COUNT``
  0 or unset, the last rank SIGKILLs itself before the optimizer step of iteration ``ITER``;
  with ``MAX_RESTARTS`` >= 1 the job resumes from its last checkpoint. A launcher that does not
  count attempts, srun or a requeue, kills it again whenever it replays ``ITER``).
* ``megatron_patches.apply(model, block, optimizer=...)`` right after megatron's
  ``setup_model_and_optimizer`` returns (the one place megatron builds both), so the per-unit
  norms ride megatron's clip-norm all-reduce and the plan is applied from the next iteration.
* Checkpoints: the GNMR state is a common (non-sharded, rank-identical) entry ``"gnmr"`` of
  every megatron checkpoint (added in ``checkpointing.generate_state_dict``), and is restored
  from the checkpoint megatron loads (``--load``). A loaded checkpoint without it is refused
  unless the block says ``"on_missing_state": "fresh"``.
* Logging on megatron's iteration axis (``training_log``): the block's trace file (rank 0),
  ``gnmr/*`` scalars (the decision's counts, the global gradient norm, and ``gnmr/risk/<unit>``
  for each active unit) through megatron's own TensorBoard and W&B writers when
  ``log.monitor`` is true and the step is a multiple of ``log.every``, and the console line
  (:mod:`gnmr_dist.integrations.console`) every ``log.console`` steps on rank 0.

Without CUDA (CPU hosts, tests) ``megatron_patches.cpu`` with ``training=True`` is enabled and
the program appends the Megatron-LM flags a CPU run needs and does not yet say
(``--distributed-backend gloo --transformer-impl local --use-cpu-initialization`` and every
fusion off), logging which; an explicit flag that contradicts one of them is refused. With
``--use-distributed-optimizer`` it also adds ``--dist-ckpt-optim-fully-reshardable``: with
megatron's default ``dp_reshardable`` optimizer checkpoint, a CPU run (torch Adam) resumed from
``--load`` diverges from the uninterrupted run from the first step after loading (measured:
tests/megatron/test_megatron_lm.py's resume, norms 2% apart at that step), while the
``fully_reshardable`` format resumes it exactly. GPU runs keep megatron's default.

Paths: ``--gnmr-config`` and ``--gnmr-trace`` are read as given, relative to the working
directory; ``gnmr-launch`` resolves the paths of a shipped ``.args`` set relative to that file.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from gnmr_dist.integrations.config import GNMRBlock, read_block
from gnmr_dist.integrations.session import refuse_probe
from gnmr_dist.train import megatron_gpt
from gnmr_dist.train.common import setup_logging
from gnmr_dist.train.megatron_hooks import Hooks

__all__ = [
    "CPU_FLAGS",
    "add_gnmr_args",
    "check_args",
    "check_data_split",
    "cpu_argv",
    "main",
]

logger = logging.getLogger(__name__)

CPU_FLAGS: dict[str, str | None] = {
    "--distributed-backend": "gloo",
    "--transformer-impl": "local",
    "--use-cpu-initialization": None,
    "--no-gradient-accumulation-fusion": None,
    "--no-masked-softmax-fusion": None,
    "--no-bias-gelu-fusion": None,
    "--no-bias-swiglu-fusion": None,
    "--no-bias-dropout-fusion": None,
    "--no-rope-fusion": None,
    "--no-persist-layer-norm": None,
}
"""Megatron-LM flags a CPU run needs (value, or ``None`` for a switch): gloo, megatron-core's
own layers (TE needs CUDA), CPU initialisation, and no CUDA-only fused kernel."""

_RESHARDABLE = "--dist-ckpt-optim-fully-reshardable"
_SPIKE = re.compile(r"^(\d+):(\d+)(?::([0-9.eE+-]+))?$")


# =============================================================================== arguments


def add_gnmr_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the GNMR arguments."""
    group = parser.add_argument_group(title="GNMR")
    group.add_argument(
        "--gnmr-config",
        default=None,
        metavar="FILE",
        help='JSON "gnmr" block (or a DeepSpeed config with one); unset: GNMR off',
    )
    group.add_argument(
        "--gnmr-backend",
        default=None,
        metavar="NAME",
        help="override the block's backend ('none': GNMR observes only)",
    )
    group.add_argument(
        "--gnmr-trace",
        default=None,
        metavar="FILE",
        help="override the block's log.trace (JSON-lines, rank 0)",
    )
    group.add_argument(
        "--gnmr-inject-grad-spike",
        action="append",
        default=[],
        metavar="ITER:LAYER[:FACTOR]",
        help="multiply layer LAYER's gradients by FACTOR at iteration ITER",
    )
    group.add_argument(
        "--gnmr-fail-at",
        type=int,
        default=None,
        metavar="ITER",
        help="restart drill: on a job's first attempt the last rank sends itself SIGKILL "
        "before the optimizer step of iteration ITER",
    )
    return parser


CUSTOMARY = {"--eval-interval": "1000"}
"""Megatron-LM flags whose default became ``None`` in megatron-core 0.17's ``megatron.training``
while its loop still divides by them (``train_iters // eval_interval`` when it sizes the
validation split, unless ``--skip-train`` or ``--full-validation``): given Megatron-LM's
customary value (its ``arguments.py`` defaulted ``--eval-interval`` to 1000) when absent."""


def customary_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` plus the :data:`CUSTOMARY` flags it lacks (each added is logged)."""
    out = list(argv)
    if "--skip-train" in argv or "--full-validation" in argv:
        return out
    for flag, value in CUSTOMARY.items():
        if flag not in argv and not any(w.startswith(flag + "=") for w in argv):
            out += [flag, value]
            logger.info(
                "%s not given: Megatron-LM's customary %s (megatron-core 0.17+ leaves it unset "
                "and then fails sizing the validation split)",
                flag,
                value,
            )
    return out


def cpu_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` plus the :data:`CPU_FLAGS` it lacks; ``ValueError`` on a contradicting flag."""
    out = list(argv)
    added = []
    for flag, value in CPU_FLAGS.items():
        if flag in argv:
            given = argv[argv.index(flag) + 1] if value is not None else None
            if given != value:
                raise ValueError(
                    f"{flag} {given}: not available without CUDA; on CPU this program needs "
                    f"{flag} {value} (drop the flag, or run on a GPU host)"
                )
            continue
        out += [flag] if value is None else [flag, value]
        added.append(flag if value is None else f"{flag} {value}")
    if "--use-distributed-optimizer" in argv and _RESHARDABLE not in argv:
        out.append(_RESHARDABLE)  # see the module docstring: dp_reshardable resumes inexactly
        added.append(_RESHARDABLE)
    if added:
        logger.info("no CUDA: megatron_patches.cpu on, added %s", " ".join(added))
    return out


def _read_block(args: argparse.Namespace, check_host: bool = True) -> GNMRBlock | None:
    """The effective ``"gnmr"`` block (file, then the overrides), or ``None`` without a file.

    Read once (``read_block``): building the backend checks its option blocks, and
    ``megatron_patches.apply`` takes that backend; a backend this host cannot load (``te_fp8``
    without CUDA) is an error only when ``check_host``.
    """
    if args.gnmr_config is None:
        return None
    path = args.gnmr_config
    try:
        given = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"--gnmr-config {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--gnmr-config {path}: not valid JSON ({err})") from None
    if isinstance(given, dict) and isinstance(given.get("gnmr"), dict):
        given = given["gnmr"]  # a DeepSpeed-style config
    if not isinstance(given, dict):
        raise ValueError(f"--gnmr-config {path}: expected a JSON object (the gnmr block)")
    block = dict(given)
    if args.gnmr_backend is not None:
        none = args.gnmr_backend.lower() in ("none", "null")
        block["backend"] = None if none else args.gnmr_backend
    if args.gnmr_trace is not None:
        block["log"] = {**dict(block.get("log") or {}), "trace": args.gnmr_trace}
    parsed = GNMRBlock.of(block, path=f"{path}: gnmr")
    refuse_probe(parsed, "gnmr-megatron-pretrain")
    return read_block(parsed, f"{path}: gnmr", check_host=check_host)


def _spikes(texts: Sequence[str]) -> list[tuple[int, int, float]]:
    out = []
    for text in texts:
        match = _SPIKE.match(text)
        if match is None:
            raise ValueError(
                f"--gnmr-inject-grad-spike {text!r}: expected ITER:LAYER[:FACTOR], e.g. 30:1:100"
            )
        out.append((int(match[1]), int(match[2]), float(match[3] or 100.0)))
    return out


def _fail_at(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"--gnmr-fail-at must be an iteration >= 1, got {value}")
    return value


# =============================================================================== CLI


_LEGACY_SPLIT = "969, 30, 1"
"""Megatron-LM's ``--split`` when ``--data-path`` is given without one (``validate_args``)."""


def check_data_split(data_path: Sequence[str] | None, split: str | None, mock: bool) -> None:
    """``ValueError`` when ``--split`` leaves a split of positive weight without a sequence of a
    single ``--data-path`` prefix.

    megatron-core splits a GPT data set by sequence (one per document as written by
    ``gnmr-prepare-data``): split ``i`` holds sequences ``round(b_i n)`` to ``round(e_i n)``.
    An empty one never finishes building: ``GPTDataset._get_num_epochs`` adds epochs of zero
    tokens until the requested tokens are reached, so the run would hang before its first
    step. A blend, mock data or a prefix not on this host is not checked.
    """
    if mock or not data_path or len(data_path) != 1 or not Path(data_path[0] + ".idx").is_file():
        return
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, split = data_path[0], split or _LEGACY_SPLIT
    n = len(IndexedDataset(prefix, mmap=True).sequence_lengths)
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for name, bounds in zip(("train", "valid", "test"), matrix, strict=True):
        if bounds is not None and round(bounds[0] * n) == round(bounds[1] * n):
            raise ValueError(
                f"--data-path {prefix} holds {n} sequences and --split {split!r} leaves the "
                f"{name} split none of them: megatron-core would loop forever building that "
                f"empty split. Write more documents (gnmr-prepare-data writes one per file) or "
                f"give the {name} split weight 0"
            )


INSTALL_MEGATRON = (
    "Python 3.12+: pip install 'gnmr-dist[megatron]' (megatron-core 0.17+). Python 3.11: "
    "megatron-core 0.17.1 declares Requires-Python >= 3.12 but ships cp311 wheels: pip install "
    "--ignore-requires-python megatron-core==0.17.1"
)
"""What installs a megatron-core with Megatron-LM's training loop, on either Python."""


def _require_training() -> None:
    """``ValueError`` unless this megatron-core ships an importable ``megatron.training``."""
    try:
        from gnmr_dist.integrations.megatron.versions import megatron_series, series_info

        series = megatron_series()
    except ImportError:
        raise ValueError(
            "gnmr-megatron-pretrain runs Megatron-LM's training loop, and megatron-core is not "
            f"installed. {INSTALL_MEGATRON}"
        ) from None
    if not series_info(what="gnmr-megatron-pretrain").has_training:
        raise ValueError(
            f"gnmr-megatron-pretrain runs Megatron-LM's training loop (megatron.training), which "
            f"megatron-core {series} does not ship (0.17+ does). {INSTALL_MEGATRON}"
        )
    try:
        import megatron.training.training  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"megatron.training of megatron-core {megatron_series()} does not import on Python "
            f"{sys.version_info.major}.{sys.version_info.minor} ({err}); 0.19's needs Python "
            "3.12+ (typing.override): use Python 3.12 or megatron-core 0.17.1"
        ) from None


def check_args(argv: Sequence[str], world_size: int, check_host: bool = True) -> None:
    """Check ``argv`` as a launch of ``world_size`` processes would run it, in this process.

    megatron's own ``parse_args`` (with :func:`add_gnmr_args`) and ``validate_args`` (layout,
    batch sizes, precision flags), then the GNMR block and the spike options. ``check_host``:
    also what depends on this machine (no CUDA: the CPU flags; a backend it cannot load).
    Raises ``ValueError`` (megatron's assertion message, or GNMR's); an unknown or malformed
    flag exits through argparse (status 2, message on stderr), as megatron itself would.
    """
    import contextlib
    import io
    import os

    _require_training()
    argv = customary_argv(argv)
    if not torch.cuda.is_available():
        from gnmr_dist.integrations.megatron.cpu import enable_cpu_compat

        argv = cpu_argv(argv) if check_host else argv
        enable_cpu_compat(training=True)  # validate_args asks torch.cuda for the device arch
    from megatron.training.arguments import parse_args, validate_args

    saved = sys.argv, {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    sys.argv = ["gnmr-megatron-pretrain", *argv]
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # megatron prints every argument
            args = parse_args(add_gnmr_args)
            validate_args(args, {})
    except AssertionError as err:
        raise ValueError(f"megatron: {err}") from None
    finally:
        sys.argv = saved[0]
        for key, value in saved[1].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _check_batches(args)
    check_data_split(args.data_path, args.split, args.mock_data)
    _read_block(args, check_host=check_host)
    _spikes(args.gnmr_inject_grad_spike)


def _check_batches(args: argparse.Namespace) -> None:
    """megatron's own micro-batch calculator for the parsed sizes (what ``pretrain`` builds
    first, after ``validate_args``), built and dropped again."""
    from megatron.core import num_microbatches_calculator as calculator

    try:
        calculator._build_num_microbatches_calculator(
            0,
            args.rampup_batch_size,
            args.global_batch_size,
            args.micro_batch_size,
            args.data_parallel_size,
            args.decrease_batch_size_if_needed,
        )
    except AssertionError as err:
        raise ValueError(f"megatron: {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``gnmr-megatron-pretrain``: Megatron-LM's ``pretrain`` for GPT with GNMR."""
    setup_logging()  # every rank at INFO: megatron's own logs come from the last rank
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _require_training()
    except ValueError as err:
        logger.error("%s", err)
        return 2
    argv = customary_argv(argv)
    if not torch.cuda.is_available():
        from gnmr_dist.integrations.megatron.cpu import enable_cpu_compat

        try:
            argv = cpu_argv(argv)
        except ValueError as err:
            logger.error("%s", err)
            return 2
        enable_cpu_compat(training=True)
    megatron_gpt.prebuilt_dataset_helpers()
    hooks = Hooks()
    try:
        gnmr_args = _gnmr_namespace(argv)
        hooks.spikes = _spikes(gnmr_args.gnmr_inject_grad_spike)
        hooks.fail_at = _fail_at(gnmr_args.gnmr_fail_at)
        hooks.block = _read_block(gnmr_args)  # a bad block fails before any process group
        check_data_split(gnmr_args.data_path, gnmr_args.split, gnmr_args.mock_data)
    except ValueError as err:
        logger.error("%s", err)
        return 2
    hooks.install()
    sys.argv = [sys.argv[0], *argv]  # megatron's parse_args reads sys.argv
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    try:
        pretrain(
            megatron_gpt.datasets_provider,
            megatron_gpt.model_provider,
            ModelType.encoder_or_decoder,
            megatron_gpt.forward_step,
            extra_args_provider=add_gnmr_args,
        )
    finally:
        if hooks.trace is not None:
            hooks.trace.close()
    return 0


def _gnmr_namespace(argv: Sequence[str]) -> argparse.Namespace:
    """The GNMR arguments, and the data flags :func:`check_data_split` reads, as Megatron-LM
    will parse them (its parser reads everything later)."""
    parser = add_gnmr_args(argparse.ArgumentParser(add_help=False))
    parser.add_argument("--data-path", nargs="*", default=None)
    parser.add_argument("--split", default=None)
    parser.add_argument("--mock-data", action="store_true")
    return parser.parse_known_args(argv)[0]
