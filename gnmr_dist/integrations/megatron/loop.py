"""GNMR on Megatron-LM's own training loop (``megatron.training.pretrain``): :func:`attach`
before the script calls ``pretrain``, :func:`detach` to undo it.

:func:`attach` wraps, through one :class:`~gnmr_dist.integrations.patching.Patches`, the
megatron.training functions ``pretrain`` looks up at call time:

* ``training.setup_model_and_optimizer``: ``megatron_patches.apply(model, block,
  optimizer=...)`` right after it returns (the one place megatron builds both), so the per-unit
  norms ride megatron's clip-norm all-reduce; the GNMR state of a loaded checkpoint is restored
  there, and the caller's ``step_wrappers`` wrap ``optimizer.step``;
* ``checkpointing.generate_state_dict`` / ``_load_base_checkpoint``: the GNMR state is the
  common (rank-identical) entry ``"gnmr"`` of every megatron checkpoint, restored from the one
  megatron loads (refused when missing unless ``"on_missing_state": "fresh"``);
* ``training.training_log``: the trace file (rank 0), ``gnmr/*`` scalars through megatron's own
  TensorBoard and W&B writers, the console line, on megatron's iteration axis
  (:class:`~gnmr_dist.integrations.megatron.report.Reporter`);
* ``training.train``: the run's accounting summary when training ends (returns, or exits
  through megatron's exit conditions);
* ``datasets.utils.compile_helpers``: the wheel's compiled data set helpers are used (the
  megatron-core wheels ship no Makefile for them).

:func:`detach` puts every one of them back, with what ``apply`` patched. The command-line side
(the ``--gnmr-*`` flags, ``sys.argv``, the CPU flags) is the program's:
:mod:`gnmr_dist.train.megatron_flags`. docs/megatron.md, "Megatron-LM's training loop".
"""

from __future__ import annotations

import atexit
import inspect
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.console import emit
from gnmr_dist.integrations.megatron.gnmr import apply, current, remove
from gnmr_dist.integrations.megatron.report import Reporter
from gnmr_dist.integrations.patching import Patches
from gnmr_dist.integrations.state_file import restore_or_refuse

__all__ = [
    "INSTALL_MEGATRON",
    "Hooks",
    "StepWrapper",
    "attach",
    "attached",
    "detach",
    "require_training",
]

logger = logging.getLogger(__name__)

StepWrapper = Callable[[Sequence[Any], Callable[..., Any]], Callable[..., Any]]
"""Given megatron's model chunks and ``optimizer.step``, the step to use instead (a drill)."""

INSTALL_MEGATRON = (
    "Python 3.12+: pip install 'gnmr-dist[megatron]' (megatron-core 0.17+). Python 3.11: "
    "megatron-core 0.17.1 declares Requires-Python >= 3.12 but ships cp311 wheels: pip install "
    "--ignore-requires-python megatron-core==0.17.1"
)
"""What installs a megatron-core with Megatron-LM's training loop, on either Python."""

_PATCHES = Patches("megatron_patches.attach")
_ATTACHED: list[Hooks] = []


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
    if not series_info(what="megatron_patches.attach").has_training:
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


class Hooks:
    """GNMR's attachment to megatron.training: built by :func:`attach`, installed once."""

    def __init__(self, block: GNMRBlock | None, step_wrappers: Sequence[StepWrapper]) -> None:
        self.block = block
        self.step_wrappers = list(step_wrappers)
        self.applied = False  # whether the setup hook applied GNMR (detach removes it)
        self.loaded: dict[str, Any] | None = None  # the "gnmr" entry of the loaded checkpoint
        self.checkpoint_loaded = False
        self.reporter: Reporter | None = None  # the trace, scalars and summary, once applied

    # ------------------------------------------------------------------ install

    def close(self) -> None:
        """Close the trace file (at exit, or on :func:`detach`)."""
        if self.reporter is not None:
            self.reporter.close()

    def install(self) -> None:
        """Wrap the megatron.training functions GNMR rides (module attributes, looked up at
        call time by ``pretrain``), and megatron's data set helper build."""
        from megatron.core.datasets import utils as dataset_utils
        from megatron.training import checkpointing, training

        for owner, name, wrap in (
            (training, "setup_model_and_optimizer", self._after_setup),
            (training, "training_log", self._after_log),
            (training, "train", self._summarised),
            (checkpointing, "generate_state_dict", self._with_state),
            (checkpointing, "_load_base_checkpoint", self._capture),
            (dataset_utils, "compile_helpers", _prebuilt_or),
        ):
            _PATCHES.set(owner, name, wrap(getattr(owner, name)))

    def _after_setup(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
            model, optimizer, scheduler = original(*args, **kwargs)
            self._attach(model, optimizer)
            for wrap in self.step_wrappers:
                _PATCHES.set(optimizer, "step", wrap(model, optimizer.step))
            return model, optimizer, scheduler

        return setup_model_and_optimizer

    def _attach(self, model: list[Any], optimizer: Any) -> None:
        from megatron.training import get_args

        if self.block is None or not self.block.enabled:
            return
        handle = apply(model, self.block, optimizer=optimizer)
        self.applied = True
        handle.install_rerun_hooks()
        self._restore(handle, get_args())
        self.reporter = Reporter(self.block, handle, source="megatron.training")

    def _restore(self, handle: Any, args: Any) -> None:
        if not self.checkpoint_loaded or args.iteration == 0:
            return
        assert self.block is not None
        where = f"--load {args.load} (iteration {args.iteration})"
        found = ("missing", None) if self.loaded is None else ("ok", self.loaded)
        restored = restore_or_refuse(self.block, where, found, handle)
        if restored and torch.distributed.get_rank() == 0:
            step = handle.controller.step_count
            emit(f"gnmr: state restored at controller step {step} from {where}")

    # ------------------------------------------------------------------ checkpoints

    def _with_state(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def generate_state_dict(*args: Any, **kwargs: Any) -> Any:
            state = original(*args, **kwargs)
            handle = current()
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

        handle = current()
        if handle is None or self.reporter is None:
            return
        loss = loss_dict.get("lm loss")
        writers = (get_tensorboard_writer(), get_wandb_writer())
        self.reporter.record(handle, iteration, None if loss is None else float(loss), writers)

    def _summarised(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def train(*args: Any, **kwargs: Any) -> Any:
            try:
                result = original(*args, **kwargs)
            except SystemExit:  # megatron's exit conditions (--exit-interval, signals, ...)
                self._finish()
                raise
            self._finish()
            return result

        return train

    def _finish(self) -> None:
        handle = current()
        if handle is not None and self.reporter is not None:
            self.reporter.finish(handle)


def _prebuilt_or(original: Callable[[], None]) -> Callable[[], None]:
    """``compile_helpers`` that uses the wheel's compiled ``helpers_cpp`` when it imports.

    ``initialize_megatron`` calls ``megatron.core.datasets.utils.compile_helpers``, which runs
    ``make`` in the package directory; the megatron-core wheels ship the compiled extension
    and no Makefile, so that ``make`` fails and megatron exits. Compile only when it is absent.
    """

    def compile_helpers() -> None:
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    return compile_helpers


def attached() -> Hooks | None:
    """The hooks :func:`attach` installed in this process (``None`` before, and after
    :func:`detach`)."""
    return _ATTACHED[0] if _ATTACHED else None


def attach(block: GNMRBlock | None, *, step_wrappers: Sequence[StepWrapper] = ()) -> None:
    """Attach GNMR to Megatron-LM's training loop; call it once, before ``pretrain``.

    ``block``: the ``"gnmr"`` block, already read and checked
    (:func:`gnmr_dist.integrations.config.read_block`); ``None`` or disabled: GNMR stays off
    (checkpoints and ``step_wrappers`` still pass through). ``step_wrappers`` wrap
    ``optimizer.step`` in order, after GNMR's own. Raises ``ValueError`` when this megatron-core
    has no usable ``megatron.training``, ``RuntimeError`` when already attached.
    """
    if _ATTACHED:
        raise RuntimeError("megatron_patches.attach: already attached in this process")
    require_training()
    hooks = Hooks(block, step_wrappers)
    hooks.install()
    _ATTACHED.append(hooks)
    atexit.register(hooks.close)


def detach() -> None:
    """Undo :func:`attach`: every patched function (and ``optimizer.step``) is the original
    object again, GNMR's ``apply`` is removed, the trace file closed (no-op if not attached)."""
    if not _ATTACHED:
        return
    hooks = _ATTACHED.pop()
    hooks.close()
    atexit.unregister(hooks.close)
    _PATCHES.restore()
    if hooks.applied:
        remove()
