"""``engine.gnmr``: the GNMR session of one DeepSpeed engine (:class:`DeepSpeedGNMR`), built by
:func:`gnmr_dist.integrations.deepspeed.initialize` (what it does, step by step: that module's
docstring): the step hook, the recovery-gap probe, the trace and monitor logging, and the GNMR
state beside every checkpoint.

**The learning rate** the controller gets (``lr=``, for the lr_decay clock) is that of the
optimizer's first parameter group, read in the step hook *before* ``_take_model_step`` runs the
optimizer step and then DeepSpeed's ``lr_scheduler.step()``: the rate the optimizer applies to
this step's gradients, ``lr_t``. Read after it, it would be the next step's.

**A step DeepSpeed skips** (its ZeRO 1-2 optimizers skip a step whose gradients hold an inf or
NaN, in fp32 and bf16 as in fp16; ``engine.was_step_applied()`` is False) leaves the controller
untouched and goes to :meth:`GNMRRuntime.skip <gnmr_dist.distributed.GNMRRuntime.skip>`, which
counts its non-finite units and names the run's first in one warning on every rank; Trainer's
interval counts it (``skipped_steps``, and its units in ``num_nonfinite``), and the trace
record of the retried step says how many attempts were skipped before it (``skipped_steps``)
and lists their non-finite units (``skipped_nonfinite``). Until that record is written the
skipped attempts are part of the GNMR state, so a checkpoint saved right after one loses
nothing.

**GNMR's step and the engine's.** GNMR's step ``t`` is the ``t``-th optimizer step the engine
*applied* since GNMR started: the clock DeepSpeed's own ``lr_scheduler`` runs on (it is not
stepped on a skipped step either), where ``engine.global_steps`` counts every attempt. So for
every trace record ``engine_step - engine_skipped_steps - step`` (both in ``extra``) is the same
number, the header's ``engine_step_at_start - engine_skipped_at_start``: the engine's applied
steps before GNMR's step 1 (0 for a run GNMR started with; the checkpoint's for a restart whose
GNMR state started fresh). docs/telemetry.md#steps-and-skipped-steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gnmr_dist.backends import PrecisionBackend, StepReport
from gnmr_dist.core import Decision
from gnmr_dist.distributed import GNMRRuntime, UnitNorms, UnitRegistry
from gnmr_dist.distributed.probe import ProbeResult, RecoveryProbe
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.console import console_line, emit
from gnmr_dist.integrations.deepspeed.grads import grad_piece_fn
from gnmr_dist.integrations.session import (
    AccountingLog,
    IntegrationSession,
    Interval,
    error_source,
    open_trace,
    telemetry_scalars,
    trace_fields,
)
from gnmr_dist.integrations.state_file import read_state, restore_or_refuse, write_atomic
from gnmr_dist.state import RunState
from gnmr_dist.telemetry import TraceWriter
from gnmr_dist.telemetry.selection import top_k
from gnmr_dist.telemetry.trace import ProbeRecord

__all__ = ["STATE_FILE", "DeepSpeedGNMR", "probe_loss"]

logger = logging.getLogger(__name__)

STATE_FILE = "gnmr_state.pt"
"""The GNMR state's file name inside each DeepSpeed checkpoint tag directory."""


def probe_loss(output: Any) -> torch.Tensor:
    """The loss in a forward's ``output``: a scalar tensor, ``output.loss`` or ``output["loss"]``.

    Raises ``RuntimeError`` naming ``gnmr.probe``, what the forward returned and the fix.
    """
    if isinstance(output, Mapping):
        loss = output.get("loss")
    else:
        loss = output if torch.is_tensor(output) else getattr(output, "loss", None)
    if torch.is_tensor(loss) and loss.numel() == 1 and loss.is_floating_point():
        return loss if loss.dim() == 0 else loss.reshape(())
    raise RuntimeError(
        f"gnmr.probe: the model's forward returned {_describe(output)}, not a loss. The probe "
        "differentiates the loss the forward returns: a scalar tensor, or an output with .loss "
        "or a mapping with 'loss' (a Hugging Face model given labels=). Return the loss from "
        "forward, or drop the gnmr.probe key"
    )


def _describe(output: Any) -> str:
    name = type(output).__name__
    if torch.is_tensor(output):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, Mapping):
        return f"a {name} with keys {list(output)} (no tensor 'loss')"
    if hasattr(output, "loss"):
        return f"a {name} with loss={type(output.loss).__name__}"
    return f"a {name}"


def _adam_state(engine: Any, registry: UnitRegistry) -> torch.optim.Optimizer | None:
    """``engine.optimizer`` when it is a torch Adam/AdamW whose state is keyed by the module's
    own parameters (ZeRO 0, fp32), so the probe can read ``exp_avg_sq``; else ``None``."""
    opt = engine.optimizer
    if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        return None
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    return opt if all(id(p) in held for p in registry.params if p.requires_grad) else None


def _autocast(engine: Any) -> Any:
    """DeepSpeed's ``torch_autocast`` region of ``engine.forward`` (0.19)."""
    from deepspeed.runtime.torch_autocast import autocast_if_enabled

    return autocast_if_enabled(engine)


class DeepSpeedGNMR(IntegrationSession):
    """GNMR attached to a DeepSpeed engine (``engine.gnmr``)."""

    def __init__(
        self,
        engine: Any,
        registry: UnitRegistry,
        backend: PrecisionBackend | None,
        block: GNMRBlock,
    ) -> None:
        self.engine, self.registry, self.backend, self.block = engine, registry, backend, block
        dp = dist.get_world_size(engine.data_parallel_group)
        self.runtime = GNMRRuntime(
            registry,
            block.policy,
            group=engine.data_parallel_group,
            grad_fn=grad_piece_fn(engine),
            check_group=dist.group.WORLD,
            check_consistency=block.check_consistency,
            error_fn=error_source(block, backend, registry.num_units),
            error_scale=1.0 / dp,
            error_every=block.error_every,
            gemms=block.gemms,
        )
        self.skipped = 0
        self.interval = Interval()
        """The decisions since the last Trainer log (:mod:`~.deepspeed.trainer`)."""
        self.trainer_accounting = AccountingLog()
        """The accounting entries of Trainer's logs (:mod:`~.deepspeed.trainer_log`)."""
        self._monitor_accounting = AccountingLog()
        self._skipped_nonfinite: list[int] = []  # of the skipped attempts of the coming step
        self._skipped_attempts = 0  # attempts skipped since the last decision
        self._trace: TraceWriter | None = None
        self._notes: dict[str, float] = {}
        self.probe: RecoveryProbe | None = None
        """The recovery-gap probe (``gnmr.probe``; ``None``: off)."""
        self.last_probe: ProbeRecord | None = None
        """The last probe step's measurements and graded sets (identical on every rank)."""
        self.last_report: StepReport | None = None
        """Which path each unit ran in the last optimizer step, read before the next plan is
        applied (``backend.report()`` itself restarts with every plan, so after
        ``engine.step()`` it is the new step's, still empty); ``None`` before the first step."""
        self._dp = dp
        self._probe_due = False  # the next training forward opens a cycle whose plan is fresh
        self._measured: tuple[ProbeResult, float] | None = None
        adam = _adam_state(engine, registry)
        self._has_update_gap = adam is not None
        if block.probe is not None and backend is not None:
            self.probe = RecoveryProbe(registry, backend, adam, dp_group=engine.data_parallel_group)
        self._install_hooks()
        self._apply_plan()

    # ------------------------------------------------------------------ public view

    def note(self, **values: float) -> None:
        """Attach numbers (e.g. ``loss=...``) to the next decision's trace record."""
        self._notes.update({k: float(v) for k, v in values.items()})

    def telemetry(self) -> dict[str, float]:
        """The last decision's counts plus the global gradient norm and skipped steps."""
        d, n = self.runtime.last_decision, self.runtime.last_norms
        out = dict(d.telemetry.as_dict()) if d is not None else {}
        if n is not None:
            out["global_grad_norm"] = n.global_norm
        out["skipped_steps"] = float(self.skipped)
        return out

    # ------------------------------------------------------------------ hooks

    def _install_hooks(self) -> None:
        engine = self.engine
        take_step, forward = engine._take_model_step, engine.forward
        save, load = engine.save_checkpoint, engine.load_checkpoint

        def take_model_step(*args: Any, **kwargs: Any) -> Any:
            # local sums now (gradients final, not yet unscaled/clipped/consumed); the one
            # all-reduce runs while the optimizer steps
            finish = self.runtime.monitor.start(
                grad_scale=self._grad_scale(), with_errors=self.runtime.plan.measure_errors
            )
            # hook order: norms are started first (gradients final), then the lr read, then
            # DeepSpeed's step, then the decision: the plan is set before the next forward
            lr = self._applied_lr()  # before the optimizer and the scheduler step: lr_t
            result = take_step(*args, **kwargs)
            self._after_step(finish(), lr)
            return result

        def gnmr_forward(*args: Any, **kwargs: Any) -> Any:
            # the probe runs before the step's own forward, while the backend's report is empty
            self._maybe_probe(args, kwargs)
            if self.backend is None:
                return forward(*args, **kwargs)
            # every forward of the step, activation recomputation included, runs the plan
            with self.backend.step_context():
                return forward(*args, **kwargs)

        engine._take_model_step = take_model_step
        engine.forward = gnmr_forward
        # GNMR's file is written before DeepSpeed's files and its latest tag (kill safety)
        engine.save_checkpoint = lambda *a, **kw: self._save(save, *a, **kw)
        engine.load_checkpoint = lambda *a, **kw: self._load(load, *a, **kw)

    def _apply_plan(self) -> None:
        super()._apply_plan()
        self._probe_due = True  # a fresh plan: the next training forward opens the cycle

    def _maybe_probe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The probe, on a probe step's first training forward of the cycle, before it runs."""
        if self.probe is None or self.block.probe is None or not self._probe_due:
            return
        if not (self.engine.module.training and torch.is_grad_enabled()):
            return  # an evaluation forward: the cycle has not started
        self._probe_due = False
        if not self.block.probe.due(self.runtime.plan.step):
            return
        if self.backend is not None and self.backend.report().ran:
            super()._apply_plan()  # evaluation forwards ran since the plan: a fresh report
        t0 = time.perf_counter()
        result = self.probe.measure(lambda: self._probe_loss(args, kwargs))
        self._measured = (result, 1e3 * (time.perf_counter() - t0))

    def _probe_loss(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """The forward as ``engine.forward`` runs it, its loss over the data-parallel size."""
        context = self.backend.step_context() if self.backend else contextlib.nullcontext()
        with context, _autocast(self.engine):
            output = self.engine.module(*args, **kwargs)
        return probe_loss(output) / self._dp

    def _take_probe(self, decision: Decision, ran: frozenset[int]) -> ProbeRecord | None:
        """This step's probe as a trace record (``ran``: the plan the step ran), or ``None``."""
        measured, self._measured = self._measured, None
        if measured is None or measured[0].step != decision.step or self.block.probe is None:
            return None
        r, ms = measured
        k = self.block.probe.k
        sets = {
            "risk_topk": top_k(decision.risk, k),
            "active": ran,
            "decided": frozenset(decision.active),
        }
        self.last_probe = ProbeRecord(
            step=decision.step,
            k=k,
            grad_gap=r.grad_gap,
            update_gap=r.update_gap if self._has_update_gap else None,
            grad_low_norm=r.grad_low_norm,
            grad_high_norm=r.grad_high_norm,
            loss_low=r.loss_low,
            loss_high=r.loss_high,
            sets=sets,
            probe_ms=ms,
        )
        return self.last_probe

    def _applied_lr(self) -> float | None:
        """The learning rate of the optimizer's first parameter group (``None``: no optimizer
        DeepSpeed knows, e.g. a client optimizer stepped outside the engine)."""
        rates = self.engine.get_lr()
        return float(rates[0]) if rates else None

    def _grad_scale(self) -> float:
        """The fp16 loss scale the gradients still carry at the hook (1 for fp32/bf16)."""
        return float(getattr(self.engine.optimizer, "loss_scale", 1.0) or 1.0)

    def _after_step(self, norms: UnitNorms, lr: float | None = None) -> None:
        if self.backend is not None:  # read before apply() starts the next step's report
            self.last_report = self.backend.report()
        # an overflow skip: the controller never sees it, so its history stays untouched
        # and the plan is kept for the retried step
        if not self.engine.was_step_applied():
            self.skipped += 1
            self._skipped_attempts += 1
            bad = self.runtime.skip(norms)
            self._skipped_nonfinite += bad
            self.interval.skip(len(bad), self.runtime.controller.step_count)
            logger.warning(
                "gnmr: optimizer step skipped (overflow); controller history left untouched, "
                "plan kept: %s",
                sorted(self.runtime.plan.active),
            )
            self._measured = None  # the retried step is probed again, on its own batch
            self._apply_plan()
            return
        # the plan this step ran, read before observe() publishes the next one
        ran = self.runtime.plan.active
        decision = self.runtime.observe(norms, lr=lr)
        self.interval.add(decision, norms.global_norm, ran)
        probe = self._take_probe(decision, ran)
        self._apply_plan()
        skipped = (self._skipped_nonfinite, self._skipped_attempts)
        # the next trace record reports them: reset once the decision has taken them
        self._skipped_nonfinite, self._skipped_attempts = [], 0
        self._log(norms, decision, probe, (*skipped, lr))

    # ------------------------------------------------------------------ logging

    def report(self) -> list[str]:
        """Write the run's accounting (:meth:`summary_lines`) where the console line goes, on
        rank 0, and return the lines (every rank): the end-of-run report, which
        :class:`~gnmr_dist.GNMRCallback` and ``gnmr-ds-pretrain`` call when training ends."""
        lines = self.summary_lines()
        if dist.get_rank() == 0:
            for line in lines:
                emit(line)
        return lines

    def _log(
        self,
        norms: UnitNorms,
        decision: Decision,
        probe: ProbeRecord | None,
        step: tuple[list[int], int, float | None],
    ) -> None:
        """Rank 0: the trace record, the console line and the monitor's events of a decision;
        ``step``: the non-finite units of its skipped attempts, how many attempts were skipped
        and the learning rate applied."""
        if dist.get_rank() != 0:
            return
        trace = self._trace_writer()
        samples = int(self.engine.global_samples)  # DeepSpeed's own monitor axis
        extra = {
            "global_norm": norms.global_norm,
            "engine_step": int(self.engine.global_steps),
            "engine_skipped_steps": int(self.engine.skipped_steps),
            "engine_samples": samples,
        }
        extra.update(self._notes)
        self._notes = {}
        if trace is not None:
            skipped, attempts, lr = step
            fields = trace_fields(self.runtime, norms, skipped, attempts)
            if lr is not None:
                fields["lr"] = lr
            trace.write(norms.norms, decision, extra, probe=probe, fields=fields)
        monitor = getattr(self.engine, "monitor", None)
        log = self.block.log
        if log.console and decision.step % log.console == 0:
            emit(console_line(decision, norms.global_norm, self.registry.names, samples))
        if decision.step % log.every:
            return
        if log.monitor and monitor is not None and monitor.enabled:
            tele = telemetry_scalars(decision, norms.global_norm)
            tele.update(
                self._monitor_accounting.scalars(self.runtime.summary(), self.registry.names)
            )
            monitor.write_events([(f"gnmr/{k}", v, samples) for k, v in tele.items()])

    def _trace_writer(self) -> TraceWriter | None:
        if self._trace is None:
            done = self.runtime.controller.step_count - 1  # decided before this run's first record
            self._trace = open_trace(self.block, self.registry, done, **self._engine_at_start())
        return self._trace

    def _engine_at_start(self) -> dict[str, int]:
        """The engine's ``global_steps`` and ``skipped_steps`` when GNMR stood at step 0 (the
        trace header's ``engine_step_at_start`` / ``engine_skipped_at_start``): now's, less the
        steps GNMR has decided and the attempts it saw skipped since it started (module
        docstring). Call it between optimizer steps."""
        gnmr = self.runtime.controller.step_count + self.skipped
        return {
            "engine_step_at_start": int(self.engine.global_steps) - gnmr,
            "engine_skipped_at_start": int(self.engine.skipped_steps) - self.skipped,
        }

    # ------------------------------------------------------------------ state

    def _pending(self) -> tuple[int, list[int]]:
        """The attempts skipped since the last decision, which the next trace record reports
        (saved as ``skipped_pending``, only while there are some)."""
        return self._skipped_attempts, list(self._skipped_nonfinite)

    def restore(self, run: RunState) -> None:
        """:meth:`IntegrationSession.restore`, and the skipped attempts the saved run had not
        reported yet (checked with the rest by :func:`gnmr_dist.state.read_run`)."""
        super().restore(run)
        self._skipped_attempts, self._skipped_nonfinite = run.pending[0], list(run.pending[1])

    def reset(self) -> None:
        super().reset()
        self._skipped_attempts, self._skipped_nonfinite = 0, []

    # ------------------------------------------------------------------ checkpoints

    def _save(self, save: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Write the GNMR state atomically into the tag's directory, then let DeepSpeed write
        its files and its ``latest`` tag: a kill at any instant leaves ``latest`` naming a
        checkpoint whose GNMR state is complete (module docstring, item 6)."""
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        path = Path(save_dir, tag, STATE_FILE)
        failed: list[str | None] = [None]
        if dist.get_rank() == 0:
            try:
                write_atomic(self.state_dict(), path)
            except OSError as err:  # a full disk, a read-only mount: every rank stops with it
                failed[0] = f"{type(err).__name__}: {err}"
        dist.broadcast_object_list(failed, src=0)
        if failed[0] is not None:
            raise OSError(f"gnmr: cannot write {path} ({failed[0]}); the checkpoint was not saved")
        return save(save_dir, tag, *args, **kwargs)

    def _load(self, load: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        tag = tag if tag is not None else _latest_tag(load_dir)
        result = load(load_dir, tag, *args, **kwargs)
        if result[0] is None:
            return result  # DeepSpeed found nothing to load and said so
        self._restore(Path(load_dir, str(tag), STATE_FILE))
        return result

    def _restore(self, path: Path) -> None:
        """Rank 0 reads the state and hands it to every rank, so all ranks restore the same."""
        found: list[Any] = [read_state(path) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0)
        restored = restore_or_refuse(self.block, str(path), found[0], self)
        if dist.get_rank() != 0:
            return
        if restored:
            step = self.runtime.controller.step_count
            emit(f"gnmr: state restored at controller step {step} from {path}")
            return
        at = self._engine_at_start()["engine_step_at_start"]
        emit(
            f"gnmr: the controller starts fresh at engine step {at} and counts its steps from 1 "
            "again (the trace: extra.engine_step in each record, meta.engine_step_at_start)"
        )


def _latest_tag(load_dir: str) -> str | None:
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as fh:
        return fh.read().strip()
