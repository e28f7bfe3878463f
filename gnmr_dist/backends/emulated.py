"""``fp8_emulated``: linear layers whose GEMM inputs are rounded to FP8/FP6/FP4, on any device.

The backend switches every wrapped linear between two quantized linears
(:mod:`~gnmr_dist.backends.emulated_linear`), one per path, each configured by its option block
(:mod:`~gnmr_dist.backends.emulated_options`): by default e4m3 with DeepSeek-V3's 1 x 128 /
128 x 128 block scales on the low-cost path and bf16 GEMM inputs on the recovery path; a path
whose formats are both ``fp32`` is plain ``F.linear``. It reproduces the numerics, not the speed:
on a CPU the rounding costs a few elementwise passes per GEMM.

What the backend adds to the linear:

* Stochastic rounding draws from a generator seeded per call by the path's ``seed`` option, the
  step, the unit, the operator and the call's number in the step (:meth:`EmulatedBackend.
  _call_key`): every rank that holds the same values draws the same bits, a resumed run draws
  what the uninterrupted one would have, and the probe's passes never shift the training draws.
* The error score ``B(u)`` (``gnmr.gamma``, after ``track_errors``): on the low-cost path the
  wgrad GEMM reports it; a unit on the recovery path is measured in shadow, ``Q_M(x)`` at the
  low-cost format once in the forward and ``Q_M(dy)`` in a hook on the output gradient, only to
  take the norms (with the seed the low-cost path would have drawn with).
* ``gnmr.gemms``: a recovered unit runs the GEMMs listed on the recovery spec and the others
  on the low-cost spec, each with its own path's seed (:meth:`EmulatedBackend._subset_call`);
  ``B(u)`` is then measured by the real wgrad GEMM when wgrad stays low-cost (``docs/gemms.md``).
* Delayed scaling (``"scaling": "delayed"``, :mod:`~gnmr_dist.backends.emulated_scaling`): one
  history entry per optimizer step, committed by :meth:`EmulatedBackend.apply`; a unit entering
  a path starts that path's histories afresh; :meth:`EmulatedBackend.measuring` reads them and
  never records, commits or resets; histories are not checkpointed. The reasons, and where TE
  differs: ``docs/backends.md#delayed-scaling``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends.base import LOW_COST, RECOVERY, PrecisionBackend
from gnmr_dist.backends.emulated_linear import EmulatedCall, EmulatedProbe, InputNorms
from gnmr_dist.backends.emulated_options import EmulatedOptions, LinearQuantSpec
from gnmr_dist.backends.emulated_scaling import DelayedScales, amax_of, commit_all, scale_of
from gnmr_dist.backends.error_sums import GemmProbe
from gnmr_dist.backends.gemms import ALL_GEMMS, subset_error
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.numerics.scaled import quantize_dequantize_scaled
from gnmr_dist.backends.registry import register_backend

__all__ = ["EmulatedBackend"]

logger = logging.getLogger(__name__)


@register_backend("fp8_emulated")
class EmulatedBackend(PrecisionBackend):
    """Emulated FP8/FP6/FP4 GEMMs on the low-cost path, bf16 (or any format) on recovery.

    Options: ``low_cost`` / ``recovery`` blocks of :class:`EmulatedOptions`; defaults
    ``{"format": "e4m3"}`` (1x128 / 128x128 block scales) and ``{"format": "bf16"}``. A path with
    ``"scaling": "delayed"`` keeps amax histories per operator (module docstring).

    ``"gnmr"``::

        {"backend": "fp8_emulated", "low_cost": {"format": "e4m3"},
         "recovery": {"format": "bf16"}, "max_active": 4}
    """

    reports_errors = True
    adapted_gemms = True
    LowCost = EmulatedOptions
    Recovery = EmulatedOptions
    recovery_defaults: ClassVar[Mapping[str, Any]] = {"format": "bf16"}
    low_cost: EmulatedOptions
    recovery: EmulatedOptions

    def __init__(self, **blocks: Any) -> None:
        super().__init__(**blocks)
        self.specs = {
            LOW_COST: LinearQuantSpec.from_options(self.low_cost),
            RECOVERY: LinearQuantSpec.from_options(self.recovery),
        }
        self._last_input: tuple[Any, int, InputNorms] = (None, 0, InputNorms())
        self._delayed: dict[int, dict[str, DelayedScales]] = {}  # id(operator) -> path -> state
        self._measuring = False
        self._training_plan: frozenset[int] = frozenset()  # the plan measuring() was entered in
        self._stand_ins: dict[tuple[int, str], DelayedScales] = {}  # (id(op), path), measuring
        self._calls: dict[int, int] = {}  # id(op) -> calls this step (stochastic rounding)
        self._probe_calls: dict[int, int] = {}  # the same inside measuring()
        self._columns: dict[int, torch.Tensor] = {}  # id(op) -> gradient column scales

    def check_gemms(self, gemms: frozenset[str]) -> None:
        """Any subset, on current scaling: each GEMM's inputs are quantized inside that GEMM.
        Delayed scaling is refused with a subset: one amax history per tensor serves two GEMMs
        (x: fprop and wgrad, W: fprop and dgrad, dy: dgrad and wgrad), and would have to run on
        both paths at once."""
        if gemms == ALL_GEMMS:
            return
        for path, options in (("gnmr.low_cost", self.low_cost), ("gnmr.recovery", self.recovery)):
            if options.scaling == "delayed":
                raise subset_error(
                    self.name,
                    gemms,
                    f"{path} uses delayed scaling, whose amax history per tensor serves two "
                    "GEMMs (x: fprop and wgrad, W: fprop and dgrad, dy: dgrad and wgrad), so one "
                    "history would run on both paths at once",
                    'use "scaling": "current" on both paths, or recover all three GEMMs',
                )

    # ------------------------------------------------------------------ delayed scaling

    def apply(self, active: Iterable[int], step: int) -> None:
        """Commit the finished step's amaxes to the delayed-scaling histories when ``step``
        advances (not inside :meth:`measuring`), then set the plan as
        :meth:`PrecisionBackend.apply` does.

        An ``apply`` that does not advance the step (the same step set again: a step DeepSpeed
        or megatron skipped and runs again, a plan re-applied after evaluation forwards or by
        the recovery-gap probe) drops the amaxes recorded since the last one: only the forwards
        of the step that trains enter the history.
        """
        if not self._measuring:
            self._calls = {}
            histories = [h for d in self._all_delayed() for h in d.histories]
            if step > self._step:
                commit_all(histories)
            else:
                for h in histories:
                    h.drop_step()
        super().apply(active, step)

    def _all_delayed(self) -> Iterator[DelayedScales]:
        for paths in self._delayed.values():
            yield from paths.values()

    def on_plan_change(self, before: frozenset[int], after: frozenset[int]) -> None:
        """A unit entering a path starts that path's histories afresh (not inside
        :meth:`measuring`): back from recovery, a stale low-cost history must not overflow."""
        if self._measuring:
            self._set_stand_ins(after)
            return
        if not self._delayed:
            return
        entering = [(u, LOW_COST) for u in before - after] + [(u, RECOVERY) for u in after - before]
        reset = 0
        for uid, path in entering:
            for op in self._wrapped.get(uid, ()):
                state = self._delayed.get(id(op), {}).get(path)
                if state is not None:
                    state.reset()
                    reset += 1
        if reset:
            logger.debug("%s: reset the amax histories of %d operators", self.name, reset)

    def _set_stand_ins(self, plan: frozenset[int]) -> None:
        """Inside :meth:`measuring`: an empty history for every (operator, path) that ``plan``
        runs but the training plan does not (what entering the path would start with)."""
        training = self._training_plan
        entering = [(u, LOW_COST) for u in training - plan] + [
            (u, RECOVERY) for u in plan - training
        ]
        want = {
            (id(op), path)
            for uid, path in entering
            if self.specs[path].delayed is not None
            for op in self._wrapped.get(uid, ())
        }
        self._stand_ins = {
            key: self._stand_ins.get(key) or DelayedScales.of(self.specs[key[1]]) for key in want
        }

    def _scales_now(
        self, op: nn.Module, path: str, scales: DelayedScales | None
    ) -> DelayedScales | None:
        """``scales``, or the operator's stand-in history on ``path`` inside :meth:`measuring`."""
        return self._stand_ins.get((id(op), path), scales) if self._measuring else scales

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Histories are read but not recorded, committed or reset inside (probe passes,
        evaluation): what runs inside does not change the training run's scales. A unit moved to
        another path inside uses a stand-in history there (``docs/backends.md#delayed-scaling``)."""
        outer, self._measuring = self._measuring, True
        if not outer:
            self._training_plan, self._stand_ins, self._probe_calls = self._recover, {}, {}
        try:
            yield
        finally:
            self._measuring = outer
            if not outer:
                self._stand_ins = {}

    def delayed_scales(self, op: nn.Module, path: str = LOW_COST) -> DelayedScales | None:
        """The delayed-scaling state of wrapped operator ``op`` on ``path`` (``None``: that path
        uses current scaling)."""
        if self.specs[path].delayed is None:
            return None
        paths = self._delayed.setdefault(id(op), {})
        if path not in paths:
            paths[path] = DelayedScales.of(self.specs[path])
        return paths[path]

    def unwrap(self) -> None:
        """Remove every installed forward and drop the delayed-scaling state."""
        super().unwrap()
        self._delayed.clear()

    # ------------------------------------------------------------------ forwards

    def make_gemm(self, op: nn.Module, path: str) -> Callable[..., torch.Tensor]:
        spec, low = self.specs[path], self.specs[LOW_COST]
        path_scales, low_scales = self.delayed_scales(op, path), self.delayed_scales(op, LOW_COST)
        subset = path == RECOVERY and self.gemms != ALL_GEMMS

        def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            probe, record = None, not self._measuring
            scales = self._scales_now(op, path, path_scales)
            key = self._call_key(op)
            seed = sr_seed(spec.seed, *key)
            if weight.requires_grad and not low.is_identity:
                probe = self._probe(x, op)
            if path == LOW_COST and probe is not None:
                return EmulatedCall(spec, probe, scales, record, seed)(x, weight, bias)
            if subset:
                call = self._subset_call(key, probe)
                y = call(x, weight, bias)
                if probe is not None and call.probe is None and y.requires_grad:
                    self._shadow(probe, x, y, low_scales, sr_seed(low.seed, *key))
                return y
            if spec.is_identity:
                y = F.linear(x, weight, bias)
            else:
                y = EmulatedCall(spec, scales=scales, record=record, seed=seed)(x, weight, bias)
            if probe is not None and y.requires_grad:
                self._shadow(probe, x, y, low_scales, sr_seed(low.seed, *key))
            return y

        return gemm

    def _subset_call(self, key: tuple[int, ...], probe: GemmProbe | None) -> EmulatedCall:
        """The call of a recovered GEMM under ``gnmr.gemms``: each GEMM on its path's spec with
        the seed that path draws with for this call (``key``), so it computes bit for bit what
        that path computes. ``probe`` goes to the real wgrad GEMM when wgrad stays low-cost;
        else the caller measures in shadow, as for a fully recovered unit."""
        calls = {
            path: EmulatedCall(self.specs[path], seed=sr_seed(self.specs[path].seed, *key))
            for path in (LOW_COST, RECOVERY)
        }
        fprop, dgrad, wgrad = (
            RECOVERY if g in self.gemms else LOW_COST for g in ("fprop", "dgrad", "wgrad")
        )
        return EmulatedCall(
            self.specs[fprop],
            probe=probe if wgrad == LOW_COST else None,
            seed=calls[fprop].seed,
            dgrad=None if dgrad == fprop else calls[dgrad],
            wgrad=None if wgrad == fprop else calls[wgrad],
        )

    def _call_key(self, op: nn.Module) -> tuple[int, ...]:
        """What the stochastic-rounding seed of this call of ``op`` is mixed from, besides the
        path's ``seed`` option: the step, the running unit, the operator's place in it, the
        call's number among the operator's calls of the step (micro-batches) and whether it is
        a measuring pass. Every rank that runs the same step draws the same bits, and so does a
        resumed run; the passes inside :meth:`measuring` count apart, so they never shift the
        training step's draws. A recovered unit's shadow uses its call's key, so it draws what
        the low-cost path would have drawn."""
        uid = -1 if self._unit is None else self._unit
        index = next((i for i, o in enumerate(self._wrapped.get(uid, ())) if o is op), -1)
        calls = self._probe_calls if self._measuring else self._calls
        n = calls.get(id(op), 0)
        calls[id(op)] = n + 1
        return self._step, uid, index, n, int(self._measuring)

    def scale_gradient_columns(self, op: nn.Module, columns: torch.Tensor | None) -> None:
        """Declare that wrapped operator ``op``'s next GEMMs run on a reparametrized weight:
        the trained parameter's gradient is the GEMM weight's with input column ``k`` times
        ``columns[k]`` (a per-channel scale moved from the weight to the input, as SmoothQuant
        does: ``x D`` and ``W D^-1`` give ``columns = 1 / diag(D)``). Their error score ``B(u)``
        is then taken on the parameter's gradient (:class:`~gnmr_dist.backends.emulated_linear.
        InputNorms`). ``None`` undoes it. Read when a GEMM's forward runs."""
        if columns is None:
            self._columns.pop(id(op), None)
        else:
            self._columns[id(op)] = columns.detach()

    def _probe(self, x: torch.Tensor, op: nn.Module) -> EmulatedProbe | None:
        """A probe for the running unit, sharing ``x``'s norms with the last GEMM of the same
        ``x`` (one slot keyed on its identity and version, as ``act_quant``'s shared pack);
        a GEMM on a reparametrized weight (:meth:`scale_gradient_columns`) has its own."""
        base = self._error_probe()
        if base is None:
            return None
        columns = self._columns.get(id(op))
        if columns is not None:
            return EmulatedProbe(base.sink, base.unit, shared=InputNorms(columns=columns))
        if self.specs[LOW_COST].delayed is not None:  # each operator has its own x scale
            return EmulatedProbe(base.sink, base.unit)
        ref, version, shared = self._last_input
        if ref is None or ref() is not x or version != x._version:
            shared = InputNorms()
            self._last_input = (weakref.ref(x), x._version, shared)
        return EmulatedProbe(base.sink, base.unit, shared=shared)

    def _shadow(
        self,
        probe: EmulatedProbe,
        x: torch.Tensor,
        y: torch.Tensor,
        low_scales: DelayedScales | None,
        seed: int,
    ) -> None:
        """Measure the low-cost wgrad error of a recovered GEMM: ``x`` now, ``dy`` in a hook.

        Under delayed scaling both are scaled by their own amax and nothing is recorded: a
        unit returning to the low-cost path starts with a reset history, whose first step
        scales each call by its own amax, so that is what the low-cost path would do now (the
        frozen history of before the recovery would score a path that never runs again).
        """
        low = self.specs[LOW_COST]
        if not probe.shared.done:  # projections of one input share its norms: cast it once
            x2 = low.rotate(_flat(x.detach()))
            probe.shared.fill(low, x2, _low_cost_q(low, low_scales, x2, "x").to(x2.dtype))
        dy_seed = EmulatedCall(low, seed=seed).seed_of(1)

        def hook(dy: torch.Tensor) -> None:
            dy2 = low.rotate(_flat(dy))
            q = _low_cost_q(low, low_scales, dy2, "dy", dy_seed).to(dy2.dtype)
            probe.record_dy(low, dy2, q)

        y.register_hook(hook)  # type: ignore[no-untyped-call]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[M, last]`` in fp32 at least."""
    t = t.reshape(-1, t.shape[-1])
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _low_cost_q(
    low: LinearQuantSpec,
    scales: DelayedScales | None,
    t: torch.Tensor,
    role: str,
    seed: int | None = None,
) -> torch.Tensor:
    """The low-cost wgrad quantization ``Q_M`` of ``t`` (role ``"x"`` or ``"dy"``; already
    rotated when the spec rotates), for the shadow measurement: the spec's tiles along M (``dy``
    rounded with ``seed`` when the spec rounds it stochastically), or, under delayed scaling,
    the scale of a reset history (``t``'s own amax, the margin applied; nothing recorded)."""
    fmt = low.x_format if role == "x" else low.grad_format
    if scales is not None:
        if fmt.is_identity:
            return t
        margin = (scales.x if role == "x" else scales.dy).recipe.margin
        return quantize_dequantize_scaled(t, fmt, scale_of(amax_of(t), fmt, margin))
    return t if fmt.is_identity else low.act(t, fmt, dim=0, seed=seed if role == "dy" else None)
