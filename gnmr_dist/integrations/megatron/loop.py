"""GNMR on Megatron-LM's own training loop (``megatron.training.pretrain``): :func:`attach`
before the script calls ``pretrain``, :func:`detach` to undo it.

:func:`attach` wraps, through one :class:`~gnmr_dist.integrations.patching.Patches`, the
megatron.training functions ``pretrain`` looks up at call time:

* ``training.setup_model_and_optimizer``: ``megatron_patches.enable(model, block,
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
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.console import emit
from gnmr_dist.integrations.megatron import ATTACH_FROM_ARGV
from gnmr_dist.integrations.megatron.gnmr import current, disable, enable
from gnmr_dist.integrations.megatron.report import Reporter
from gnmr_dist.integrations.patching import Patches
from gnmr_dist.integrations.state_file import restore_or_refuse
from gnmr_dist.integrations.switch import Enabled, deprecated

__all__ = [
    "INSTALL_MEGATRON",
    "TRAINING_NEEDS",
    "Hooks",
    "Needed",
    "StepWrapper",
    "attached",
    "disable_loop",
    "enable_loop",
    "require_modules",
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

_PATCHES = Patches("megatron_patches.enable_loop")
_ATTACHED: list[Hooks] = []


@dataclass(frozen=True)
class Needed:
    """A module outside megatron-core's own dependencies that Megatron-LM's loop imports."""

    module: str
    """What megatron imports (``yaml``, ``torch.utils.tensorboard``)."""
    package: str
    """The pip package that installs it."""
    why: str
    """Where megatron imports it, and what fails without it."""
    flag: str | None = None
    """Needed only when this Megatron-LM flag is given (``None``: on every run)."""
    values: tuple[str, ...] = ()
    """... with one of these values (empty: any value)."""

    def asked_by(self, argv: Sequence[str]) -> str | None:
        """Whether a run of ``argv`` needs the module: ``""`` always, ``", for FLAG VALUE"``
        when its flag asks for it, ``None`` when it does not."""
        if self.flag is None:
            return ""
        value = None  # the last one given wins, as in argparse
        for i, word in enumerate(argv):
            if word == self.flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif word.startswith(self.flag + "="):
                value = word.partition("=")[2]
        if not value or (self.values and value not in self.values):
            return None
        return f", for {self.flag} {value}"


_SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
_HF_TOKENIZERS = (
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "BertWordPieceCase",
    "BertWordPieceLowerCase",
    "SFTTokenizer",
)

TRAINING_NEEDS: tuple[Needed, ...] = (
    Needed("yaml", "pyyaml", "megatron.training.initialize imports it (yaml_arguments)"),
    Needed(
        "psutil",
        "psutil",
        "megatron-core's checkpoint writer (dist_checkpointing filesystem_async) reads its "
        "memory with it: without it the first --save fails",
    ),
    Needed(
        "torch.utils.tensorboard",
        "tensorboard",
        "megatron's TensorBoard writer: without it megatron writes no TensorBoard log and only "
        "warns",
        flag="--tensorboard-dir",
    ),
    Needed("wandb", "wandb", "megatron's W&B writer", flag="--wandb-project"),
    Needed(
        "sentencepiece",
        "sentencepiece",
        "megatron-core's SentencePiece tokenizer",
        flag="--tokenizer-type",
        values=_SENTENCEPIECE,
    ),
    Needed(
        "tiktoken",
        "tiktoken",
        "megatron-core's tiktoken tokenizer",
        flag="--tokenizer-type",
        values=("TikTokenizer",),
    ),
    Needed(
        "transformers",
        "transformers",
        "megatron-core's Hugging Face tokenizers",
        flag="--tokenizer-type",
        values=_HF_TOKENIZERS,
    ),
)
"""What Megatron-LM's ``pretrain`` imports on the route GNMR ships (the loop, checkpoint saves,
its writers, its tokenizers) beyond megatron-core's own dependencies (torch, numpy, packaging):
megatron-core lists these only in its ``training`` extra, with others GNMR's route never
imports. The ``megatron`` extra installs the unflagged ones and those the shipped argument sets
use (``--tensorboard-dir``, the LLaMA tokenizer); :func:`require_modules` checks them at start.
tests/integrations/megatron/test_requirements.py reads megatron's sources and fails on an import
this table (or its list of optional ones) does not know."""


def require_modules(argv: Sequence[str] | None = None) -> None:
    """``ValueError`` unless every module of :data:`TRAINING_NEEDS` a run of ``argv`` needs
    imports; it names each missing one, its package and the pip command that installs them.

    ``argv``: the Megatron-LM arguments (default ``sys.argv[1:]``, what megatron parses), for
    the modules a flag asks for. Checked before anything is built: without it a missing module
    surfaced as megatron's own traceback, ``psutil``'s only at the first checkpoint save.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    missing = []
    for need in TRAINING_NEEDS:
        asked = need.asked_by(words)
        if asked is None:
            continue
        try:
            importlib.import_module(need.module)
        except Exception as err:  # a broken install fails megatron as a missing one would
            missing.append(
                (need, f"{need.package} (module {need.module!r}{asked}: {err}; {need.why})")
            )
    if missing:
        packages = " ".join(dict.fromkeys(need.package for need, _ in missing))
        raise ValueError(
            "Megatron-LM's training loop needs Python packages that do not import here: "
            + "; ".join(text for _, text in missing)
            + f". Install them: pip install {packages}"
        )


def _import_error(series: str, err: ImportError) -> str:
    """What an ``ImportError`` of ``megatron.training`` means, and its fix."""
    module = (err.name or "").split(".")[0]
    if module in sys.stdlib_module_names:
        return (
            f"megatron.training of megatron-core {series} does not import on Python "
            f"{sys.version_info.major}.{sys.version_info.minor} ({err}): it needs a newer "
            "Python's standard library (0.19's needs Python 3.12+, typing.override): use a "
            "newer Python, or megatron-core 0.17.1"
        )
    if module and module != "megatron":
        return (
            f"megatron.training of megatron-core {series} imports {module!r}, which does not "
            f"import here ({err}): install the package that provides {module!r}"
        )
    return f"megatron.training of megatron-core {series} does not import ({err})"


def require_training(argv: Sequence[str] | None = None) -> None:
    """``ValueError`` unless this megatron-core ships an importable ``megatron.training`` and
    every module a run of ``argv`` needs imports (:func:`require_modules`)."""
    try:
        from gnmr_dist.integrations.megatron.versions import megatron_series, series_info

        series = megatron_series()
    except ImportError:
        raise ValueError(
            "GNMR on Megatron-LM's training loop, and megatron-core is not "
            f"installed. {INSTALL_MEGATRON}"
        ) from None
    if not series_info(what="megatron_patches.enable_loop").has_training:
        raise ValueError(
            f"GNMR on Megatron-LM's training loop (megatron.training), which "
            f"megatron-core {series} does not ship (0.17+ does). {INSTALL_MEGATRON}"
        )
    require_modules(argv)
    try:
        import megatron.training.training  # noqa: F401
    except ImportError as err:
        raise ValueError(_import_error(series, err)) from None


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
            # the one place megatron builds both model and optimizer: enable GNMR right here
            model, optimizer, scheduler = original(*args, **kwargs)
            self._attach(model, optimizer)
            # the drills wrap optimizer.step after GNMR's own wrapper (enable wrapped it first)
            for wrap in self.step_wrappers:
                _PATCHES.set(optimizer, "step", wrap(model, optimizer.step))
            return model, optimizer, scheduler

        return setup_model_and_optimizer

    def _attach(self, model: list[Any], optimizer: Any) -> None:
        from megatron.training import get_args

        if self.block is None or not self.block.enabled:
            return
        handle = enable(model, self.block, optimizer=optimizer)
        self.applied = True
        handle.install_rerun_hooks()
        self._restore(handle, get_args())
        self.reporter = Reporter(self.block, handle, source="megatron.training")

    def _restore(self, handle: Any, args: Any) -> None:
        # a fresh run (or a finetune from iteration 0) starts the controller fresh
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
                # take a pending decision first: the saved plan is the one the next step runs
                handle.settle()
                # a common, non-sharded entry: every rank holds the same state
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


_NO_BLOCK: Any = object()
"""``attach()`` called without a block: the old command-line call, refused with its successor."""


def enable_loop(
    block: GNMRBlock | None = _NO_BLOCK, *, step_wrappers: Sequence[StepWrapper] = ()
) -> Enabled:
    """Enable GNMR on Megatron-LM's training loop; call it once, before ``pretrain``. Also a
    context manager: ``with enable_loop(block): pretrain(...)`` disables it after.

    ``block``: the ``"gnmr"`` block, already read and checked
    (:func:`gnmr_dist.integrations.config.read_block`); ``None`` or disabled: GNMR stays off
    (checkpoints and ``step_wrappers`` still pass through). ``step_wrappers`` wrap
    ``optimizer.step`` in order, after GNMR's own. Raises ``TypeError`` without a block (or with
    an argument provider: the old ``loop.attach()`` call, whose successor it names),
    ``ValueError`` when this megatron-core has no usable ``megatron.training`` or a module it
    needs does not import, ``RuntimeError`` when already attached.
    """
    if block is _NO_BLOCK or not (block is None or isinstance(block, GNMRBlock)):
        given = "no block" if block is _NO_BLOCK else f"a {type(block).__name__}"
        raise TypeError(
            f'megatron_patches.enable_loop(block) takes the "gnmr" block (a GNMRBlock or None) '
            f"and was given {given}: attach() reading --gnmr-* from sys.argv was the old "
            f"megatron_patches.loop.attach(). {ATTACH_FROM_ARGV}"
        )
    if _ATTACHED:
        raise RuntimeError("megatron_patches.enable_loop: already attached in this process")
    require_training()
    hooks = Hooks(block, step_wrappers)
    hooks.install()
    _ATTACHED.append(hooks)
    atexit.register(hooks.close)
    return Enabled(disable_loop, owned=True)


def disable_loop() -> None:
    """Undo :func:`attach`: every patched function (and ``optimizer.step``) is the original
    object again, GNMR's ``apply`` is removed, the trace file closed (no-op if not attached)."""
    if not _ATTACHED:
        return
    hooks = _ATTACHED.pop()
    hooks.close()
    atexit.unregister(hooks.close)
    _PATCHES.restore()
    if hooks.applied:
        disable()


attach = deprecated("megatron_patches.attach", "megatron_patches.enable_loop", enable_loop)
detach = deprecated("megatron_patches.detach()", "megatron_patches.disable_loop()", disable_loop)
