"""GNMR on Megatron-LM's own training loop (``megatron.training.pretrain``), for any pretrain
script: one call before the script calls ``pretrain``.

Add two lines to your ``pretrain_*.py`` (Megatron-LM's, a fork's, yours: your model, data and
forward-step providers stay as they are)::

    import megatron_patches

    if __name__ == "__main__":
        extra_args_provider = megatron_patches.loop.attach()  # reads --gnmr-* from sys.argv
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                 forward_step, extra_args_provider=extra_args_provider)

and launch it as before with ``--gnmr-config gnmr.json`` added (a script with its own
``extra_args_provider`` passes it: ``attach(extra_args_provider=mine)``). ``gnmr-megatron-pretrain``
is ``pretrain_gpt.py`` with exactly these lines. What :func:`attach` does:

* Arguments (:func:`add_gnmr_args`, added to megatron's parser): ``--gnmr-config FILE`` (JSON:
  the ``"gnmr"`` block, or a DeepSpeed config holding one; without it GNMR is off and the
  script runs as it did), ``--gnmr-backend NAME`` (overrides the block's; ``none``: observe
  only), ``--gnmr-trace FILE`` (the block's ``log.trace``), ``--gnmr-inject-grad-spike
  ITER:LAYER[:FACTOR]`` (repeatable: multiply every gradient of global transformer layer
  ``LAYER``, 0-based, by ``FACTOR`` (default 100) before the optimizer step of iteration
  ``ITER``, 1-based: a deterministic disturbance for tests and demos), ``--gnmr-fail-at ITER``
  (a restart drill under torchrun: on the job's first attempt, ``TORCHELASTIC_RESTART_COUNT``
  0 or unset, the last rank SIGKILLs itself before the optimizer step of iteration ``ITER``).
  The block is read (and its backend built) now, before any process group: a bad one fails at
  once.
* ``megatron_patches.apply(model, block, optimizer=...)`` right after megatron's
  ``setup_model_and_optimizer`` returns (the one place megatron builds both), so the per-unit
  norms ride megatron's clip-norm all-reduce and the plan is applied from the next iteration;
  any model megatron builds from your provider (chunks, virtual pipeline) is taken as it is.
* Checkpoints: the GNMR state is a common (non-sharded, rank-identical) entry ``"gnmr"`` of
  every megatron checkpoint (added in ``checkpointing.generate_state_dict``), and is restored
  from the checkpoint megatron loads (``--load``). A loaded checkpoint without it is refused
  unless the block says ``"on_missing_state": "fresh"``.
* Logging on megatron's iteration axis (``training_log``): the block's trace file (rank 0),
  ``gnmr/*`` scalars (the decision's counts, the global gradient norm, and ``gnmr/risk/<unit>``
  for each active unit) through megatron's own TensorBoard and W&B writers when
  ``log.monitor`` is true and the step is a multiple of ``log.every``, and the console line
  (:mod:`gnmr_dist.integrations.console`) every ``log.console`` steps on rank 0.
* Arguments Megatron-LM needs and 0.17+ leaves unset get its customary values
  (:data:`CUSTOMARY`). Without CUDA (CPU hosts, tests) ``megatron_patches.cpu`` with
  ``training=True`` is enabled and the flags a CPU run needs are appended (:data:`CPU_FLAGS`),
  logging which; an explicit flag that contradicts one of them is refused. With
  ``--use-distributed-optimizer`` it also adds ``--dist-ckpt-optim-fully-reshardable``: with
  megatron's default ``dp_reshardable`` optimizer checkpoint, a CPU run (torch Adam) resumed
  from ``--load`` diverges from the uninterrupted run from the first step after loading, while
  the ``fully_reshardable`` format resumes it exactly. GPU runs keep megatron's default.
  ``sys.argv`` is rewritten with these (megatron's parser reads it). megatron-core wheels ship
  the data sets' compiled helpers but not their Makefile: the compiled ones are used
  (:func:`prebuilt_dataset_helpers`).

Paths: ``--gnmr-config`` and ``--gnmr-trace`` are read as given, relative to the working
directory.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import json
import logging
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gnmr_dist.integrations.config import GNMRBlock, read_block
from gnmr_dist.integrations.console import console_line, emit
from gnmr_dist.integrations.session import (
    open_trace,
    refuse_probe,
    telemetry_scalars,
)
from gnmr_dist.integrations.state_file import restart_drill, restore_or_refuse

__all__ = [
    "CPU_FLAGS",
    "CUSTOMARY",
    "INSTALL_MEGATRON",
    "Hooks",
    "add_gnmr_args",
    "attach",
    "attached",
    "check_fail_at",
    "cpu_argv",
    "customary_argv",
    "gnmr_block",
    "gnmr_namespace",
    "parse_spikes",
    "prebuilt_dataset_helpers",
    "require_training",
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


# ============================================================== arguments


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


def gnmr_block(args: argparse.Namespace, check_host: bool = True) -> GNMRBlock | None:
    """The effective ``"gnmr"`` block (file, then the overrides), or ``None`` without a file.

    Read once (``read_block``): building the backend checks its option blocks
    (``megatron_patches.apply`` builds the run's own, with megatron's operators); a backend this
    host cannot load (``te_fp8`` without CUDA) is an error only when ``check_host``.
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
    refuse_probe(parsed, "GNMR on Megatron-LM's loop")
    checked, _ = read_block(parsed, f"{path}: gnmr", check_host=check_host)
    return checked


def parse_spikes(texts: Sequence[str]) -> list[tuple[int, int, float]]:
    out = []
    for text in texts:
        match = _SPIKE.match(text)
        if match is None:
            raise ValueError(
                f"--gnmr-inject-grad-spike {text!r}: expected ITER:LAYER[:FACTOR], e.g. 30:1:100"
            )
        out.append((int(match[1]), int(match[2]), float(match[3] or 100.0)))
    return out


def check_fail_at(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"--gnmr-fail-at must be an iteration >= 1, got {value}")
    return value


INSTALL_MEGATRON = (
    "Python 3.12+: pip install 'gnmr-dist[megatron]' (megatron-core 0.17+). Python 3.11: "
    "megatron-core 0.17.1 declares Requires-Python >= 3.12 but ships cp311 wheels: pip install "
    "--ignore-requires-python megatron-core==0.17.1"
)
"""What installs a megatron-core with Megatron-LM's training loop, on either Python."""


def require_training() -> None:
    """``ValueError`` unless this megatron-core ships an importable ``megatron.training``."""
    try:
        from gnmr_dist.integrations.megatron.versions import megatron_series, series_info

        series = megatron_series()
    except ImportError:
        raise ValueError(
            "GNMR on Megatron-LM's training loop, and megatron-core is not "
            f"installed. {INSTALL_MEGATRON}"
        ) from None
    if not series_info(what="megatron_patches.loop").has_training:
        raise ValueError(
            f"GNMR on Megatron-LM's training loop (megatron.training), which "
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


def gnmr_namespace(argv: Sequence[str]) -> argparse.Namespace:
    """The GNMR arguments, and the data flags :func:`check_data_split` reads, as Megatron-LM
    will parse them (its parser reads everything later)."""
    parser = add_gnmr_args(argparse.ArgumentParser(add_help=False))
    parser.add_argument("--data-path", nargs="*", default=None)
    parser.add_argument("--split", default=None)
    parser.add_argument("--mock-data", action="store_true")
    return parser.parse_known_args(argv)[0]


# =================================================================== the hooks


class Hooks:
    """GNMR's attachment to megatron.training: built by :func:`attach`, installed once."""

    def __init__(self) -> None:
        self.block: GNMRBlock | None = None
        self.spikes: list[tuple[int, int, float]] = []
        self.fail_at: int | None = None
        self.loaded: dict[str, Any] | None = None  # the "gnmr" entry of the loaded checkpoint
        self.checkpoint_loaded = False
        self.trace: Any = None
        self.layers: dict[int, list[torch.nn.Parameter]] = {}
        self.logged_step: int | None = None  # the controller step of the last logged decision

    # ------------------------------------------------------------------ install

    def close(self) -> None:
        """Close the trace file (at exit)."""
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def install(self) -> None:
        """Wrap the megatron.training functions GNMR rides (module attributes, looked up at
        call time by ``pretrain``)."""
        from megatron.training import checkpointing, training

        training.setup_model_and_optimizer = self._after_setup(training.setup_model_and_optimizer)
        training.training_log = self._after_log(training.training_log)
        checkpointing.generate_state_dict = self._with_state(checkpointing.generate_state_dict)
        checkpointing._load_base_checkpoint = self._capture(checkpointing._load_base_checkpoint)

    def _after_setup(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
            model, optimizer, scheduler = original(*args, **kwargs)
            self._attach(model, optimizer)
            if self.fail_at is not None:
                optimizer.step = _failing(optimizer.step, self.fail_at)
            return model, optimizer, scheduler

        return setup_model_and_optimizer

    def _attach(self, model: list[Any], optimizer: Any) -> None:
        from megatron.training import get_args

        from gnmr_dist.integrations import megatron as megatron_patches

        if self.block is None or not self.block.enabled:
            return
        handle = megatron_patches.apply(model, self.block, optimizer=optimizer)
        handle.install_rerun_hooks()
        self._restore(handle, get_args())
        self.layers = _layer_params(model)
        if self.spikes:
            optimizer.step = self._spiking(optimizer.step)
        self.trace = self._trace_writer(handle)

    def _restore(self, handle: Any, args: argparse.Namespace) -> None:
        if not self.checkpoint_loaded or args.iteration == 0:
            return
        assert self.block is not None
        where = f"--load {args.load} (iteration {args.iteration})"
        found = ("missing", None) if self.loaded is None else ("ok", self.loaded)
        restored = restore_or_refuse(self.block, where, found, handle)
        if restored and torch.distributed.get_rank() == 0:
            step = handle.controller.step_count
            emit(f"gnmr: state restored at controller step {step} from {where}")

    def _spiking(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def spiked_step(*args: Any, **kwargs: Any) -> Any:
            from megatron.training import get_args

            iteration = get_args().curr_iteration + 1  # the iteration this step completes
            for it, layer, factor in self.spikes:
                grads = [getattr(p, "main_grad") for p in self.layers.get(layer, [])]  # noqa: B009
                if it == iteration and grads:
                    torch._foreach_mul_(grads, factor)
                    logger.info(
                        "iteration %d: layer %d gradients x %g (injected)", it, layer, factor
                    )
            return step(*args, **kwargs)

        return spiked_step

    # ------------------------------------------------------------------ checkpoints

    def _with_state(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def generate_state_dict(*args: Any, **kwargs: Any) -> Any:
            from gnmr_dist.integrations import megatron as megatron_patches

            state = original(*args, **kwargs)
            handle = megatron_patches.current()
            if handle is not None:
                handle.settle()
                state["gnmr"] = handle.state_dict()
            return state

        return generate_state_dict

    def _capture(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _load_base_checkpoint(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            state = result[0] if isinstance(result, tuple) else None
            if isinstance(state, Mapping) and "iteration" in state:
                self.checkpoint_loaded = True
                self.loaded = state.get("gnmr")
            return result

        return _load_base_checkpoint

    # ------------------------------------------------------------------ logging

    def _after_log(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def training_log(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            self._log(int(bound["iteration"]), bound.get("loss_dict") or {})
            return result

        return training_log

    def _log(self, iteration: int, loss_dict: Mapping[str, Any]) -> None:
        from megatron.training import get_tensorboard_writer, get_wandb_writer

        from gnmr_dist.integrations import megatron as megatron_patches

        handle = megatron_patches.current()
        if handle is None or self.block is None:
            return
        handle.settle()
        decision, norms = handle.last_decision, handle.runtime.last_norms
        if decision is None or norms is None or decision.step == self.logged_step:
            return  # no new decision (a skipped update): nothing new to record
        self.logged_step = decision.step
        loss = loss_dict.get("lm loss")
        extra = {"iteration": iteration, "global_norm": norms.global_norm}
        if loss is not None:
            extra["loss"] = float(loss)
        if self.trace is not None:
            self.trace.write(norms.norms, decision, extra)
        names = handle.registry.names
        log = self.block.log
        tb, wandb = get_tensorboard_writer(), get_wandb_writer()
        if log.monitor and decision.step % log.every == 0 and (tb or wandb) is not None:
            scalars = telemetry_scalars(decision, norms.global_norm)
            scalars.update({f"risk/{names[u]}": float(decision.risk[u]) for u in decision.active})
            _write_scalars(scalars, iteration, tb, wandb)
        if log.console and decision.step % log.console == 0 and torch.distributed.get_rank() == 0:
            emit(console_line(decision, norms.global_norm, names))

    def _trace_writer(self, handle: Any) -> Any:
        if self.block is None or self.block.log.trace is None:
            return None
        if torch.distributed.get_rank() != 0:
            return None
        done = handle.controller.step_count
        return open_trace(self.block, handle.registry, done, source="megatron.training")


def _failing(step: Callable[..., Any], fail_at: int) -> Callable[..., Any]:
    """``step``, preceded at iteration ``fail_at`` of a first attempt by the last rank's
    SIGKILL (``--gnmr-fail-at``)."""

    def step_or_die(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        restart_drill("--gnmr-fail-at", fail_at, get_args().curr_iteration + 1, rank, world)
        return step(*args, **kwargs)

    return step_or_die


def _write_scalars(scalars: Mapping[str, float], iteration: int, tb: Any, wandb: Any) -> None:
    """``gnmr/<name>`` scalars at megatron's ``iteration`` (megatron's writers are set on the
    ranks that log: the last rank, as megatron's own scalars)."""
    if tb is not None:
        for name, value in scalars.items():
            tb.add_scalar(f"gnmr/{name}", value, iteration)
    if wandb is not None:
        wandb.log({f"gnmr/{name}": value for name, value in scalars.items()}, iteration)


def _layer_params(model: Sequence[Any]) -> dict[int, list[torch.nn.Parameter]]:
    """This rank's parameters of each global transformer layer (0-based ``layer_number - 1``)."""
    layers: dict[int, list[torch.nn.Parameter]] = {}
    for chunk in model:
        for module in chunk.modules():
            number = getattr(module, "layer_number", None)
            if type(module).__name__ == "TransformerLayer" and isinstance(number, int):
                layers.setdefault(number - 1, []).extend(module.parameters())
    return layers


def prebuilt_dataset_helpers() -> None:
    """Use the wheel's compiled ``helpers_cpp`` instead of running ``make`` on its sources.

    ``initialize_megatron`` calls ``megatron.core.datasets.utils.compile_helpers``, which runs
    ``make`` in the package directory; the megatron-core wheels ship the compiled extension
    and no Makefile, so that ``make`` fails and megatron exits. Compile only when it is absent.
    """
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers

    def compile_helpers() -> None:
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    dataset_utils.compile_helpers = compile_helpers


_ATTACHED: list[Hooks] = []


def attached() -> Hooks | None:
    """The hooks :func:`attach` installed in this process (``None`` before)."""
    return _ATTACHED[0] if _ATTACHED else None


def print_help(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> None:
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


def attach(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    *,
    argv: Sequence[str] | None = None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """Attach GNMR to Megatron-LM's training loop; returns the ``extra_args_provider`` to pass
    to ``pretrain`` (the GNMR arguments, after ``extra_args_provider``'s own when given).

    Call it once, before ``pretrain``. Reads the GNMR arguments from ``argv`` (default
    ``sys.argv[1:]``), checks them and the block, installs the hooks (module docstring) and
    sets ``sys.argv`` to the arguments megatron will parse. Raises ``ValueError`` naming what is
    wrong (the block, a flag, the megatron-core), ``RuntimeError`` when called twice.
    """
    if _ATTACHED:
        raise RuntimeError("megatron_patches.loop.attach: already attached in this process")
    require_training()
    words = list(sys.argv[1:] if argv is None else argv)
    if "-h" in words or "--help" in words:
        print_help(extra_args_provider)
        raise SystemExit(0)
    words = customary_argv(words)
    if not torch.cuda.is_available():
        from gnmr_dist.integrations.megatron.cpu import enable_cpu_compat

        words = cpu_argv(words)
        enable_cpu_compat(training=True)
    given = gnmr_namespace(words)
    hooks = Hooks()
    hooks.spikes = parse_spikes(given.gnmr_inject_grad_spike)
    hooks.fail_at = check_fail_at(given.gnmr_fail_at)
    hooks.block = gnmr_block(given)  # a bad block fails before any process group
    hooks.install()
    prebuilt_dataset_helpers()
    _ATTACHED.append(hooks)
    atexit.register(hooks.close)
    sys.argv = [sys.argv[0], *words]  # megatron's parse_args reads sys.argv

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_gnmr_args(parser)

    return provider
