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
  ``log.monitor`` is true and the step is a multiple of ``log.every``, and one line in the
  iteration log every ``--log-interval``.

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
import inspect
import json
import logging
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gnmr_dist.integrations.config import GNMRBlock, read_block
from gnmr_dist.integrations.session import open_trace, refuse_probe, telemetry_scalars
from gnmr_dist.integrations.state_file import restart_drill, restore_or_refuse
from gnmr_dist.train.common import setup_logging

__all__ = ["CPU_FLAGS", "add_gnmr_args", "check_args", "cpu_argv", "main"]

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
    return parser  # fmt: skip


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


# =============================================================================== pretrain_gpt


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: Any = None,
    pg_collection: Any = None,
) -> Any:
    """``pretrain_gpt.py``'s GPT model from Megatron-LM's arguments (megatron-core modules)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = core_transformer_config_from_args(args)
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=args.transformer_impl == "transformer_engine",
        normalization=args.normalization, vp_stage=vp_stage,
    )  # fmt: skip
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage,
    )  # fmt: skip


def _loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of token losses, token count, and the report megatron averages over DP."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
    """``pretrain_gpt.py``'s forward step: the TP-broadcast, CP-sliced batch through the model."""
    from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank
    from megatron.training.utils import get_batch_on_this_tp_rank, is_first_or_last_pipeline_stage

    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens = labels = loss_mask = attention_mask = position_ids = None
    if is_first_or_last_pipeline_stage(vp_stage):
        batch = get_batch_on_this_cp_rank(get_batch_on_this_tp_rank(data_iterator))
        tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
        attention_mask, position_ids = batch["attention_mask"], batch["position_ids"]
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(_loss_func, loss_mask)


def datasets_provider(num_samples: Sequence[int], vp_stage: int | None = None) -> Any:
    """``pretrain_gpt.py``'s GPT data sets: megatron-core's blended builder over ``--data-path``."""
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import (
        get_blend_and_blend_per_split,
        is_first_or_last_pipeline_stage,
    )

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split, path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )  # fmt: skip

    def built_here() -> bool:
        first_or_last = is_first_or_last_pipeline_stage(vp_stage)
        return bool(first_or_last and parallel_state.get_tensor_model_parallel_rank() == 0)

    kind = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(kind, num_samples, built_here, config).build()


datasets_provider.is_distributed = True  # type: ignore[attr-defined]  # as pretrain_gpt.py


# =============================================================================== GNMR hooks


class _Hooks:
    """GNMR's attachment to megatron.training: built in :func:`main`, installed once."""

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

        from gnmr_dist.integrations.megatron import gnmr as megatron_gnmr

        if self.block is None or not self.block.enabled:
            return
        handle = megatron_gnmr.apply(model, self.block, optimizer=optimizer)
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
        if restore_or_refuse(self.block, where, found, handle):
            logger.info("GNMR state restored (controller step %d)", handle.controller.step_count)

    def _spiking(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def spiked_step(*args: Any, **kwargs: Any) -> Any:
            from megatron.training import get_args

            iteration = get_args().curr_iteration + 1  # the iteration this step completes
            for it, layer, factor in self.spikes:
                grads = [p.main_grad for p in self.layers.get(layer, [])]
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
            from gnmr_dist.integrations.megatron import gnmr as megatron_gnmr

            state = original(*args, **kwargs)
            handle = megatron_gnmr.current()
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
        from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer

        from gnmr_dist.integrations.megatron import gnmr as megatron_gnmr

        handle = megatron_gnmr.current()
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
        if iteration % get_args().log_interval == 0 and torch.distributed.get_rank() == 0:
            logger.info(
                " gnmr | step %d | exceed %d | active %d %s | max risk %.3f",
                decision.step, decision.telemetry.num_exceed, len(decision.active),
                [names[u] for u in decision.active], decision.telemetry.max_risk,
            )  # fmt: skip

    def _trace_writer(self, handle: Any) -> Any:
        if self.block is None or self.block.log.trace is None:
            return None
        if torch.distributed.get_rank() != 0:
            return None
        done = handle.controller.step_count
        return open_trace(self.block, handle.registry, done, source="megatron.training")


def _fail_at(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"--gnmr-fail-at must be an iteration >= 1, got {value}")
    return value


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


def _prebuilt_dataset_helpers() -> None:
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


# =============================================================================== CLI


def _require_training() -> None:
    """``ValueError`` unless this megatron-core ships an importable ``megatron.training``."""
    from gnmr_dist.integrations.megatron.versions import megatron_series, series_info

    if not series_info(what="gnmr-megatron-pretrain").has_training:
        raise ValueError(
            f"gnmr-megatron-pretrain runs Megatron-LM's training loop (megatron.training), which "
            f"megatron-core {megatron_series()} does not ship: install megatron-core 0.17+ "
            "(the image's 0.17.1)"
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
    argv = list(argv)
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
    _read_block(args, check_host=check_host)
    _spikes(args.gnmr_inject_grad_spike)


def _check_batches(args: argparse.Namespace) -> None:
    """megatron's own micro-batch calculator for the parsed sizes (what ``pretrain`` builds
    first, after ``validate_args``), built and dropped again."""
    from megatron.core import num_microbatches_calculator as calculator

    try:
        calculator._build_num_microbatches_calculator(
            0, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
            args.data_parallel_size, args.decrease_batch_size_if_needed,
        )  # fmt: skip
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
    if not torch.cuda.is_available():
        from gnmr_dist.integrations.megatron.cpu import enable_cpu_compat

        try:
            argv = cpu_argv(argv)
        except ValueError as err:
            logger.error("%s", err)
            return 2
        enable_cpu_compat(training=True)
    _prebuilt_dataset_helpers()
    hooks = _Hooks()
    try:
        gnmr_args = _gnmr_namespace(argv)
        hooks.spikes = _spikes(gnmr_args.gnmr_inject_grad_spike)
        hooks.fail_at = _fail_at(gnmr_args.gnmr_fail_at)
        hooks.block = _read_block(gnmr_args)  # a bad block fails before any process group
    except ValueError as err:
        logger.error("%s", err)
        return 2
    hooks.install()
    sys.argv = [sys.argv[0], *argv]  # megatron's parse_args reads sys.argv
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    try:
        pretrain(
            datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
            extra_args_provider=add_gnmr_args,
        )  # fmt: skip
    finally:
        if hooks.trace is not None:
            hooks.trace.close()
    return 0


def _gnmr_namespace(argv: Sequence[str]) -> argparse.Namespace:
    """The GNMR arguments alone (megatron's parser reads the rest later)."""
    parser = add_gnmr_args(argparse.ArgumentParser(add_help=False))
    return parser.parse_known_args(argv)[0]
