"""Deterministic disturbances for tests and demos, loaded by a program only when a drill flag
asks for one (:mod:`gnmr_dist.train.megatron_flags`, :mod:`gnmr_dist.train.ds_pretrain`).

* ``--gnmr-inject-grad-spike ITER:LAYER[:FACTOR]`` (repeatable): every gradient of global
  transformer layer ``LAYER`` (0-based) times ``FACTOR`` (default 100) before the optimizer step
  of iteration ``ITER`` (1-based). Applied only where GNMR is on, after its own step wrapper.
* ``--gnmr-fail-at ITER``: a restart drill under torchrun; on the job's first attempt
  (``TORCHELASTIC_RESTART_COUNT`` 0 or unset) the last rank SIGKILLs itself before the optimizer
  step of iteration ``ITER``
  (:func:`restart_drill`, which ``gnmr-ds-pretrain``'s ``--fail-at`` uses too).

Each drill is a :data:`~gnmr_dist.integrations.megatron.loop.StepWrapper` of ``optimizer.step``
that ``megatron_patches.enable_loop`` installs and ``detach`` removes.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # a type only: gnmr-ds-pretrain's --fail-at loads no megatron module
    from gnmr_dist.integrations.megatron.loop import StepWrapper

__all__ = ["Drills", "check_fail_at", "parse_spikes", "restart_drill"]

logger = logging.getLogger(__name__)


def restart_drill(flag: str, fail_at: int | None, step: int, rank: int, world: int) -> None:
    """The last rank SIGKILLs itself when ``step == fail_at`` on a job's first attempt
    (``TORCHELASTIC_RESTART_COUNT`` 0 or unset); ``flag`` names the option in the log line."""
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if fail_at == step and rank == world - 1 and first_attempt:
        logger.error("%s %d: rank %d sends itself SIGKILL", flag, step, rank)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


_SPIKE = re.compile(r"^(\d+):(\d+)(?::([0-9.eE+-]+))?$")


def parse_spikes(texts: Sequence[str]) -> list[tuple[int, int, float]]:
    """``(iteration, layer, factor)`` of each ``--gnmr-inject-grad-spike``; ``ValueError`` on a
    malformed one."""
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
    """``--gnmr-fail-at`` as given; ``ValueError`` unless it is an iteration (>= 1)."""
    if value is not None and value < 1:
        raise ValueError(f"--gnmr-fail-at must be an iteration >= 1, got {value}")
    return value


@dataclass(frozen=True)
class Drills:
    """The drills one run asked for."""

    spikes: list[tuple[int, int, float]]
    fail_at: int | None

    @classmethod
    def of(cls, spike_texts: Sequence[str], fail_at: int | None) -> Drills:
        """The drills of the flags' values (checked: ``ValueError`` names the flag)."""
        return cls(parse_spikes(spike_texts), check_fail_at(fail_at))

    def step_wrappers(self, gnmr_on: bool) -> list[StepWrapper]:
        """The wrappers of ``optimizer.step``, innermost first: the spikes (only with GNMR on),
        then the restart drill."""
        wrappers: list[StepWrapper] = []
        if self.spikes and gnmr_on:
            wrappers.append(self._spiking)
        if self.fail_at is not None:
            wrappers.append(self._failing)
        return wrappers

    def _spiking(self, model: Sequence[Any], step: Callable[..., Any]) -> Callable[..., Any]:
        from megatron.training import get_args

        layers = _layer_params(model)

        def spiked_step(*args: Any, **kwargs: Any) -> Any:
            iteration = get_args().curr_iteration + 1  # the iteration this step completes
            for it, layer, factor in self.spikes:
                grads = [getattr(p, "main_grad") for p in layers.get(layer, [])]  # noqa: B009
                if it == iteration and grads:
                    torch._foreach_mul_(grads, factor)
                    logger.info(
                        "iteration %d: layer %d gradients x %g (injected)", it, layer, factor
                    )
            return step(*args, **kwargs)

        return spiked_step

    def _failing(self, model: Sequence[Any], step: Callable[..., Any]) -> Callable[..., Any]:
        from megatron.training import get_args

        assert self.fail_at is not None
        fail_at = self.fail_at

        def step_or_die(*args: Any, **kwargs: Any) -> Any:
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            restart_drill("--gnmr-fail-at", fail_at, get_args().curr_iteration + 1, rank, world)
            return step(*args, **kwargs)

        return step_or_die


def _layer_params(model: Sequence[Any]) -> dict[int, list[torch.nn.Parameter]]:
    """This rank's parameters of each global transformer layer (0-based ``layer_number - 1``)."""
    layers: dict[int, list[torch.nn.Parameter]] = {}
    for chunk in model:
        for module in chunk.modules():
            number = getattr(module, "layer_number", None)
            if type(module).__name__ == "TransformerLayer" and isinstance(number, int):
                layers.setdefault(number - 1, []).extend(module.parameters())
    return layers
