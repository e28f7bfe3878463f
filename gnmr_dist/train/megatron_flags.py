"""The ``--gnmr-*`` flags of a pretrain script on Megatron-LM's loop, and the command line
megatron then parses: :func:`attach_from_argv`, the two lines any pretrain script adds::

    from gnmr_dist.train.megatron_flags import attach_from_argv

    extra_args_provider = attach_from_argv()  # reads --gnmr-* from sys.argv
    pretrain(..., extra_args_provider=extra_args_provider)

It reads the flags (:func:`add_gnmr_args`), reads and checks the block before any process group
(:func:`gnmr_block`: a bad one fails at once), loads the drills only when a drill flag asks for
one (:mod:`gnmr_dist.testing.drills`), attaches GNMR (:func:`megatron_patches.enable_loop`) and sets
``sys.argv`` to what megatron will parse: plus Megatron-LM's customary values megatron-core 0.17+
leaves unset (:data:`CUSTOMARY`) and, without CUDA, the flags a CPU run needs (:data:`CPU_FLAGS`,
with ``gnmr_dist.testing.megatron_cpu`` turned on). Paths are read relative to the working
directory. docs/megatron.md, "Megatron-LM's training loop" and "CPU compatibility".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gnmr_dist.integrations.config import GNMRBlock, check_block_name, read_block
from gnmr_dist.integrations.megatron.loop import attached, enable_loop, require_training
from gnmr_dist.integrations.session import refuse_probe
from gnmr_dist.train.common import import_modules

if TYPE_CHECKING:
    from gnmr_dist.testing.drills import Drills

__all__ = [
    "CPU_FLAGS",
    "CUSTOMARY",
    "add_gnmr_args",
    "attach_from_argv",
    "check_units",
    "cpu_argv",
    "customary_argv",
    "drills_of",
    "gnmr_block",
    "gnmr_namespace",
]

logger = logging.getLogger(__name__)

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

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
"""Added on CPU with ``--use-distributed-optimizer``: with megatron's default ``dp_reshardable``
optimizer checkpoint a CPU run (torch Adam) resumed from ``--load`` diverges from the
uninterrupted run from the first step after loading; ``fully_reshardable`` resumes it exactly."""

CUSTOMARY = {"--eval-interval": "1000"}
"""Megatron-LM flags whose default became ``None`` in megatron-core 0.17's ``megatron.training``
while its loop still divides by them (``train_iters // eval_interval`` when it sizes the
validation split, unless ``--skip-train`` or ``--full-validation``): given Megatron-LM's
customary value (its ``arguments.py`` defaulted ``--eval-interval`` to 1000) when absent."""


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
        "--gnmr-import",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE before reading the block (it registers a backend of your own)",
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
        out.append(_RESHARDABLE)  # dp_reshardable resumes inexactly on CPU (_RESHARDABLE)
        added.append(_RESHARDABLE)
    if added:
        logger.info("no CUDA: megatron_patches.cpu on, added %s", " ".join(added))
    return out


def one_connection_env(argv: Sequence[str]) -> bool:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` when ``argv`` asks for tensor or context
    parallelism and the variable is unset: Megatron-LM's ``validate_args`` requires it there
    (the kernel ordering its overlapped communication relies on), and on a CPU host nothing else
    sets it, so the run stopped on megatron's assertion. Returns whether it set it."""

    def size(flag: str) -> int:
        return int(argv[argv.index(flag) + 1]) if flag in argv[:-1] else 1

    parallel = size("--tensor-model-parallel-size") > 1 or size("--context-parallel-size") > 1
    if not parallel or "CUDA_DEVICE_MAX_CONNECTIONS" in os.environ:
        return False
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    logger.info(
        "no CUDA: set CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM requires it with TP/CP > 1)"
    )
    return True


def gnmr_block(args: argparse.Namespace, check_host: bool = True) -> GNMRBlock | None:
    """The effective ``"gnmr"`` block (file, then the overrides), or ``None`` without a file.

    Read once (``read_block``): building the backend checks its option blocks
    (``megatron_patches.enable`` builds the run's own, with megatron's operators); a backend this
    host cannot load (``te_fp8`` without CUDA) is an error only when ``check_host``. Given
    Megatron-LM's whole parsed ``args`` (``check_args``, which ``gnmr-launch`` runs), also checks
    the unit selection on the model they describe (:func:`check_units`).
    """
    import_modules(getattr(args, "gnmr_import", []), "--gnmr-import")
    if args.gnmr_config is None:
        return None
    path = args.gnmr_config
    try:
        given = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"--gnmr-config {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--gnmr-config {path}: not valid JSON ({err})") from None
    if isinstance(given, dict):
        check_block_name(given, f"--gnmr-config {path}")
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
    refuse_probe(parsed, "GNMR on Megatron-LM's loop")
    checked, _ = read_block(parsed, f"{path}: gnmr", check_host=check_host)
    if hasattr(args, "num_layers"):  # Megatron-LM's whole parse (check_args): the model is known
        check_units(args, checked)
    return checked


_SINGLE_PROCESS = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "sequence_parallel": False,
    "use_cpu_initialization": True,
    "perform_initialization": False,
}
"""The layout :func:`check_units` builds the model at: one process, no weights initialised."""


def check_units(args: argparse.Namespace, block: GNMRBlock | None) -> None:
    """``ValueError`` when ``block``'s ``include``/``exclude`` select no unit of the GPT model
    Megatron-LM's parsed ``args`` describe: the refusal ``megatron_patches.enable`` gives the
    run inside ``setup_model_and_optimizer``, given before any process starts.

    The program's own ``model_provider`` builds the model on the meta device in this process
    (no memory, no weights), at parallel sizes 1 (:data:`_SINGLE_PROCESS`; unit names are global,
    the same under any layout), inside a one-process gloo group on an in-memory store (no port),
    destroyed again; Transformer Engine layers are built as megatron-core's own
    (:func:`_meta_gpt`). A model it cannot build here (a mixture of experts on TE layers) is left
    to the run, with a logged warning; so is any model under an initialised process group.
    """
    if block is None or not block.enabled or not (block.include or block.exclude):
        return  # the default selection is every unit inside a layer: a GPT has them
    import torch.distributed as dist

    if dist.is_initialized():
        logger.info("gnmr: the unit selection is checked when the model is built (process group)")
        return
    try:
        model = _meta_gpt(args)
    except Exception as err:  # the run builds its own model; this check only anticipates it
        logger.warning(
            "gnmr: gnmr.include/exclude are checked when the run builds its model: this host "
            "cannot build it on the meta device (%s: %s)",
            type(err).__name__,
            err,
        )
        return
    from gnmr_dist.backends import registered_operator_types
    from gnmr_dist.distributed.units import check_selection
    from gnmr_dist.integrations.megatron.operators import MEGATRON_MARKS, MEGATRON_OPERATORS

    check_selection(
        model,
        granularity=block.units,
        include=block.include,
        exclude=block.exclude,
        operator_types=MEGATRON_OPERATORS.all_types() | registered_operator_types(),
        marks=MEGATRON_MARKS,
    )


def _local_layers() -> dict[str, object]:
    """The arguments :data:`CPU_FLAGS` set (megatron-core's own layers, no CUDA-only fusion), as
    megatron's parser sets them: what :func:`check_units` builds a model on Transformer Engine
    layers with. A dense GPT's units have the same names with either layers; a mixture of
    experts' do not."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    words = [w for flag, value in CPU_FLAGS.items() for w in (flag, value) if w is not None]
    given, default = parser.parse_known_args(words)[0], parser.parse_known_args([])[0]
    return {k: v for k, v in vars(given).items() if v != getattr(default, k)}


def _meta_gpt(args: argparse.Namespace) -> torch.nn.Module:
    """``megatron_gpt.model_provider()``'s model for ``args`` on the meta device; a model on
    Transformer Engine layers is built on megatron-core's own (:func:`_local_layers`: nothing
    is allocated on a GPU, and TE need not be installed), which name a dense GPT's units alike."""
    if getattr(args, "transformer_impl", "local") == "local":
        return _build_meta_gpt(args, {})
    if getattr(args, "num_experts", None):
        raise NotImplementedError(
            "a mixture of experts on Transformer Engine layers names its expert units otherwise "
            "on megatron-core's own layers"
        )
    return _build_meta_gpt(args, _local_layers())


def _build_meta_gpt(args: argparse.Namespace, layers: dict[str, object]) -> torch.nn.Module:
    """The model in a one-process group that is destroyed again (megatron's global arguments
    restored)."""
    import copy

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training import global_vars

    from gnmr_dist.train.megatron_gpt import model_provider

    single = copy.copy(args)
    for key, value in {**_SINGLE_PROCESS, **layers}.items():
        setattr(single, key, value)
    if getattr(single, "padded_vocab_size", None) is None:
        single.padded_vocab_size = 128  # the tokenizer's, padded; unit names do not depend on it
    saved = global_vars._GLOBAL_ARGS
    store = dist.HashStore()  # type: ignore[attr-defined]  # in memory: no port is bound
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        global_vars._GLOBAL_ARGS = single
        with torch.device("meta"):
            return model_provider()  # type: ignore[no-any-return]
    finally:
        global_vars._GLOBAL_ARGS = saved
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def gnmr_namespace(argv: Sequence[str]) -> argparse.Namespace:
    """The GNMR arguments, and the data flags the program's preflight reads, as Megatron-LM
    will parse them (its parser reads everything later)."""
    parser = add_gnmr_args(argparse.ArgumentParser(add_help=False))
    parser.add_argument("--data-path", nargs="*", default=None)
    parser.add_argument("--split", default=None)
    parser.add_argument("--mock-data", action="store_true")
    return parser.parse_known_args(argv)[0]


def drills_of(args: argparse.Namespace) -> Drills | None:
    """The drills ``args`` asks for, checked (``ValueError``), or ``None``: the drills' module
    (:mod:`gnmr_dist.testing.drills`) is imported only when a drill flag is given."""
    if not args.gnmr_inject_grad_spike and args.gnmr_fail_at is None:
        return None
    from gnmr_dist.testing.drills import Drills

    return Drills.of(args.gnmr_inject_grad_spike, args.gnmr_fail_at)


def print_help(extra_args_provider: ArgsProvider | None = None) -> None:
    """Megatron-LM's ``--help`` with the GNMR arguments (and ``extra_args_provider``'s).

    ``pretrain`` cannot print it: its first parse (``ft_integration.setup``, megatron-core
    0.17+) runs ``parse_args`` without the ``extra_args_provider`` and exits on ``--help``
    there, so the script's own flags would be missing from the text.
    """
    from megatron.training.arguments import add_megatron_arguments

    prog = Path(sys.argv[0]).name or None
    parser = argparse.ArgumentParser(
        prog=prog, description="Megatron-LM Arguments", allow_abbrev=False
    )
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    add_gnmr_args(parser).print_help()


def _in_spawned_helper() -> bool:
    """Whether this is a ``multiprocessing`` child re-importing the script as ``__mp_main__``
    (megatron's checkpoint writer, a data-loader worker under spawn): a script that calls
    :func:`attach_from_argv` at module level runs it again there, where there is no training
    to attach to, and its failure surfaced only as an ``EOFError`` at the first save."""
    import multiprocessing

    # the flag multiprocessing itself reads to refuse starting processes from that import
    # (``multiprocessing.spawn._check_not_importing_main``)
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def attach_from_argv(
    extra_args_provider: ArgsProvider | None = None, *, argv: Sequence[str] | None = None
) -> ArgsProvider:
    """Attach GNMR to Megatron-LM's training loop from the command line; returns the
    ``extra_args_provider`` to pass to ``pretrain`` (the GNMR arguments, after
    ``extra_args_provider``'s own when given).

    Call it once, before ``pretrain``. Reads the GNMR arguments from ``argv`` (default
    ``sys.argv[1:]``), checks them and the block, enables GNMR on the loop
    (:func:`megatron_patches.enable_loop`) and sets ``sys.argv`` to the arguments megatron will
    parse. Raises ``ValueError`` naming what is wrong (the block, a flag, the megatron-core),
    ``RuntimeError`` when called twice.
    """
    if _in_spawned_helper():
        logger.debug("attach_from_argv: a spawned helper process re-imports the script; no GNMR")
        return extra_args_provider or (lambda parser: parser)
    if attached() is not None:
        raise RuntimeError("attach_from_argv: GNMR is already attached in this process")
    words = list(sys.argv[1:] if argv is None else argv)
    require_training(words)
    if "-h" in words or "--help" in words:
        print_help(extra_args_provider)
        raise SystemExit(0)
    words = customary_argv(words)
    if not torch.cuda.is_available():
        from gnmr_dist.testing.megatron_cpu import enable_cpu_compat

        words = cpu_argv(words)
        one_connection_env(words)
        enable_cpu_compat(training=True)
    given = gnmr_namespace(words)
    drills = drills_of(given)
    block = gnmr_block(given)  # a bad block fails before any process group
    gnmr_on = block is not None and block.enabled
    enable_loop(block, step_wrappers=drills.step_wrappers(gnmr_on) if drills else ())
    sys.argv = [sys.argv[0], *words]  # megatron's parse_args reads sys.argv

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_gnmr_args(parser)

    return provider
