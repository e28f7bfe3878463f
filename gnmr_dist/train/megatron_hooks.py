"""GNMR's attachment to Megatron-LM's training loop (``megatron.training``), for
:mod:`gnmr_dist.train.megatron_lm`: ``megatron_patches.apply`` after
``setup_model_and_optimizer``, the GNMR state as a common checkpoint entry, the trace and the
``gnmr/*`` scalars on megatron's iteration axis, the injected gradient spikes and the restart
drill (what each does: the program's docstring).
"""

from __future__ import annotations

import argparse
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.console import console_line, emit
from gnmr_dist.integrations.session import open_trace, telemetry_scalars
from gnmr_dist.integrations.state_file import restart_drill, restore_or_refuse

__all__ = ["Hooks"]

logger = logging.getLogger("gnmr_dist.train.megatron_lm")


class Hooks:
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
