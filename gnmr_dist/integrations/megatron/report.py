"""What GNMR reports of a megatron-core run, on megatron's iteration axis (:class:`Reporter`).

Once per decided optimizer step (megatron's ``training_log`` calls it under Megatron-LM's loop;
a loop of its own calls :meth:`Reporter.record` after ``optimizer.step()``):

* the trace record (rank 0, ``log.trace``): the norms the controller saw, its decision, the
  learning rate the step applied (``lr``, what the lr_decay clock reads), the accounting's
  fields where they apply (``nonfinite``, ``skipped_nonfinite``, ``first_nonfinite``:
  :func:`~gnmr_dist.integrations.session.trace_fields`), and in ``extra`` megatron's
  ``iteration``, the loss and the global norm;
* ``gnmr/*`` scalars through megatron's TensorBoard and W&B writers (set on the ranks that log,
  the last rank, as megatron's own scalars), every ``log.every`` decisions with ``log.monitor``:
  the decision's counts, the global norm, ``gnmr/risk/<unit>`` of the units on the recovery
  path, and the run's accounting (``gnmr/accounting/*``: recovered and non-finite unit-steps,
  the recovered shares of unit-steps and of linear FLOPs, recovered steps per GEMM, and per
  unit its recovered and non-finite totals when they changed, so never a zero one:
  :class:`~gnmr_dist.integrations.session.AccountingLog`);
* the console line (rank 0, every ``log.console`` decisions).

At the end of training :meth:`Reporter.finish` writes the accounting's summary lines where the
console line goes (rank 0). The first non-finite unit of the run is named by the runtime itself,
in one warning on every rank (:class:`~gnmr_dist.distributed.GNMRRuntime`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.console import console_line, emit
from gnmr_dist.integrations.megatron.session import MegatronGNMR
from gnmr_dist.integrations.session import (
    AccountingLog,
    open_trace,
    telemetry_scalars,
    trace_fields,
)

__all__ = ["Reporter", "write_scalars"]


class Reporter:
    """The trace, scalars, console line and summary of one megatron run (module docstring).

    ``handle``: the run's :class:`MegatronGNMR`; ``source``: the trace header's
    ``meta["source"]``. The trace is opened on rank 0 when the block has ``log.trace`` (a
    resumed run drops the records after its restored step)."""

    def __init__(self, block: GNMRBlock, handle: MegatronGNMR, *, source: str) -> None:
        self.block = block
        self.trace: Any = None
        if block.log.trace is not None and _rank() == 0:
            done = handle.controller.step_count
            self.trace = open_trace(block, handle.registry, done, source=source)
        self.accounting = AccountingLog()
        self.logged_step: int | None = None  # the controller step of the last logged decision

    def close(self) -> None:
        """Close the trace file."""
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def record(
        self,
        handle: MegatronGNMR,
        iteration: int,
        loss: float | None = None,
        writers: tuple[Any, Any] = (None, None),
    ) -> bool:
        """Report the last decision at megatron's ``iteration`` (``writers``: megatron's
        TensorBoard and W&B writers of this rank, ``None`` where it has none). Returns False,
        writing nothing, when no new decision came (a skipped update)."""
        handle.settle()
        decision, norms = handle.last_decision, handle.runtime.last_norms
        if decision is None or norms is None or decision.step == self.logged_step:
            return False
        self.logged_step = decision.step
        extra: dict[str, Any] = {"iteration": iteration, "global_norm": norms.global_norm}
        if loss is not None:
            extra["loss"] = float(loss)
        if self.trace is not None:
            fields = trace_fields(handle.runtime, norms, handle.last_skipped)
            if handle.last_lr is not None:
                fields["lr"] = handle.last_lr
            self.trace.write(norms.norms, decision, extra, fields=fields)
        names, log = handle.registry.names, self.block.log
        tb, wandb = writers
        if log.monitor and decision.step % log.every == 0 and (tb or wandb) is not None:
            scalars = telemetry_scalars(decision, norms.global_norm)
            scalars.update({f"risk/{names[u]}": float(decision.risk[u]) for u in decision.active})
            scalars.update(self.accounting.scalars(handle.summary(), names))
            write_scalars(scalars, iteration, tb, wandb)
        if log.console and decision.step % log.console == 0 and _rank() == 0:
            emit(console_line(decision, norms.global_norm, names))
        return True

    def finish(self, handle: MegatronGNMR) -> list[str]:
        """The run's accounting summary lines (any pending decision taken first), written where
        the console line goes on rank 0 unless ``log.console`` is off; returned on every rank."""
        handle.settle()
        lines = handle.summary_lines()
        if self.block.log.console and _rank() == 0:
            for line in lines:
                emit(line)
        return lines


def write_scalars(scalars: Mapping[str, float], iteration: int, tb: Any, wandb: Any) -> None:
    """``gnmr/<name>`` scalars at megatron's ``iteration`` through its writers (either may be
    ``None``)."""
    if tb is not None:
        for name, value in scalars.items():
            tb.add_scalar(f"gnmr/{name}", value, iteration)
    if wandb is not None:
        wandb.log({f"gnmr/{name}": value for name, value in scalars.items()}, iteration)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
