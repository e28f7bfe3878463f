"""``fp8_emulated``: linear layers whose GEMM inputs are rounded to FP8/FP6/FP4, on any device.

A linear layer ``y = x W^T + b`` (``x``: [M tokens, K in], ``W``: [N out, K]) runs three GEMMs
per training step. Each one's inputs are fake-quantized (:mod:`gnmr_dist.backends.numerics`:
scaled, rounded to the format, scaled back) along that GEMM's reduction dimension, and the
product is accumulated in fp32, as an FP8 tensor-core GEMM does:

    forward  (reduce over K):  y  = Q_K(x)   @ Q_K(W)^T  + b
    dgrad    (reduce over N):  dx = Q_N(dy)  @ Q_N(W)
    wgrad    (reduce over M):  dW = Q_M(dy)^T @ Q_M(x)
    bias:                      db = sum_M dy               (not quantized)

With ``granularity="block"`` (the default) activations and gradients get one scale per 1 x block
tile and weights one per block x block tile, DeepSeek-V3's fine-grained recipe: tiles along the
reduction dimension let a kernel apply the scales to partial sums, and an outlier only spoils
its own tile. ``Q_K(W)`` and ``Q_N(W)`` are the same tensor for square weight tiles; ``Q_M(x)``
uses 128 x 1 tiles of ``x``. The forward saves ``x`` as given and the dequantized ``Q(W)`` (fp32,
one weight-sized buffer; with row scales it saves ``W`` and re-quantizes it along N), so wgrad
quantizes the full-precision ``x`` once. DeepSeek caches ``x`` as 1 x 128 FP8 and re-quantizes
it into 128 x 1 tiles, a second rounding this emulation does not model.

Options (one block per path, parsed strictly):

    format       "e4m3" | "e5m2" | "e3m2" | "e2m3" | "e2m1" | "bf16" | "fp16" | "fp32"  (x, W)
    grad_format  same choices or None (= format)                                         (dy)
    granularity  "tensor" | "row" | "block" | "none" | "nvfp4" | "mxfp4" or None
                 (None = "nvfp4" for e2m1, "block" for FP8/FP6, "none" for bf16/fp16/fp32)
    block        tile length along the reduction dimension (default 128; nvfp4 16, mxfp4 32)
    weight_2d    FP4: W in block x block tiles (None = true for nvfp4, false for mxfp4)
    stochastic_rounding  dy rounded stochastically (None = true for nvfp4)
    hadamard     wgrad inputs rotated by the 16 x 16 random Hadamard transform (None = true
                 for nvfp4)
    seed         stochastic rounding's seed option (default 0)
    scaling      "current" (default: each call scales by its own tensor's amax) | "delayed"
                 (Transformer Engine's recipe, below; needs "granularity": "tensor")
    amax_history_len   delayed only: steps of amax history H, int >= 1 (default 16; TE's
                       ``DelayedScaling`` default is 1024, set it to match TE)
    amax_compute_algo  delayed only: "max" over the history (default, as TE) | "most_recent"
    margin             delayed only: binades of headroom, int >= 0 (default 0, as TE)

Defaults: low-cost ``{"format": "e4m3"}`` (e4m3 for x, W and dy with 1x128 / 128x128 blocks, as
DeepSeek-V3: fine-grained scales make e5m2's extra range for gradients unnecessary; set
``"grad_format": "e5m2"`` for the hybrid recipe); recovery ``{"format": "bf16"}`` (bf16 GEMM
inputs, fp32 accumulation). A path whose formats are both ``fp32`` is the unwrapped module:
plain ``F.linear``.

FP4 (``"format": "e2m1"``): NVIDIA's NVFP4 recipe (arXiv 2509.25149) by default --
``Q_K(x)`` and ``Q_N(dy)`` in 1 x 16 blocks, ``W`` in 16 x 16 tiles (one quantized weight for
fprop and dgrad), ``dy`` rounded stochastically in both backward GEMMs, and the wgrad GEMM run
on ``Q_M(H dy)^T Q_M(H x)`` with ``H`` the 16 x 16 random Hadamard transform along the tokens
(:func:`~gnmr_dist.backends.numerics.hadamard_rotate`: ``(H dy)^T (H x) = dy^T x``); each
element of that recipe can be turned off. ``"granularity": "mxfp4"`` is OCP MXFP4: 1 x 32
blocks with power-of-two scales along each GEMM's reduction dimension, round to nearest. The
recovery path is ``{"format": "bf16"}`` (default) or an FP8 block (``{"format": "e4m3"}``).

Stochastic rounding draws from a generator seeded per call by the path's ``seed`` option, the
step, the unit, the operator and the call's number in the step (``_call_key``): never from
torch's global generator, so every rank that holds the same values draws the same bits, a
resumed run draws what the uninterrupted one would have, and the probe's passes never shift
the training step's draws.

On the CPU the rounding costs a few elementwise passes per GEMM (see the step-time check in
``tests/backends/test_fp8_emulated.py``); nothing is faster than fp32, it only behaves like FP8.

Error score (``gnmr.gamma``, docs/algorithm.md#damage-term; after ``track_errors``)
---------------------------------------------------------------------------
Both factors of the weight gradient are rounded, so per GEMM the backend reports

    ||dy||_F ||x - Q_M(x)||_F + ||Q_M(dy) - dy||_F ||x||_F

with the wgrad GEMM's own quantizers (tiles along M, the low-cost formats; a term whose format
is ``fp32`` is dropped), summed into ``B(u)``. With the Hadamard transform the two factors are
the rotated ``H x`` and ``H dy``, whose norms and product are the originals'. A stochastically
rounded ``dy`` scores its realised rounding. On the low-cost path the backward already holds
``Q_M(x)`` and ``Q_M(dy)``: the score costs two subtractions and four norms per GEMM. A unit on
the recovery path is measured in shadow: ``Q_M(x)`` at the low-cost format once in the forward
and ``Q_M(dy)`` once in a hook on the output gradient, only to take the norms (with the seed
the low-cost path would have drawn with). The rounding of
``W`` does not enter the weight gradient and is not scored. No GEMM, no host sync.

Delayed scaling (``"scaling": "delayed"``, TE's ``DelayedScaling``)
-------------------------------------------------------------------
Per-tensor scales from the amax histories of the last H steps, one per GEMM input and path of
every operator (the maths and its cost: :mod:`gnmr_dist.backends.fp8_scaling`).

Choices, where TE leaves room:

* One history entry per optimizer step (:meth:`Fp8EmulatedBackend.apply`), the max over the
  step's calls. All forwards of a step (micro-batches, activation recomputation) read one scale
  as they read one plan, so a recomputed forward reproduces the first bit for bit and adds
  nothing new. TE pushes one entry per autocast region, one micro-batch in Megatron: the same
  with one micro-batch per step. Forwards under ``no_grad`` (evaluation) count too;
  run them inside :meth:`Fp8EmulatedBackend.measuring` to keep them out.
* An empty history (first step, after a reset) scales each call by its own amax. TE starts
  from scale 1 and its first amax sets the second step's scale; from the second step on the two
  agree, without TE's unscaled first step.
* A unit whose plan returns it to the low-cost path resets its low-cost histories
  (docs/backends.md#delayed-scaling:
  a stale history must not overflow the first step back); one that enters the recovery path
  resets the recovery path's (when that path is delayed too). While a unit runs recovery its
  low-cost histories are frozen: the shadow error measurement quantizes with their scale but
  records nothing.
* Inside :meth:`Fp8EmulatedBackend.measuring` (the recovery-gap probe's passes) histories are
  read, never recorded, committed or reset, so a probe does not change the training run. A
  unit that a pass puts on another path than the training plan's quantizes there as it would
  on entering that path: with an empty stand-in history (each call by its own amax), not with
  the history it left (frozen while it runs recovery, reset before it is used again). So the
  probe's low-cost gap of a recovered unit is the gap of its return, which is also what its
  shadow error score measures.
* Not checkpointed: the backend has no ``state_dict``, so a restarted run re-seeds every
  history from the current amax, as on a return from recovery.

Layout: the option blocks, their resolved specs and the autograd linear live in
:mod:`gnmr_dist.backends.fp8_linear`, the amax histories in :mod:`gnmr_dist.backends.fp8_scaling`;
this module holds the backend and re-exports their public names.
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
from gnmr_dist.backends.fp8_linear import (
    SCALINGS,
    Fp8Call,
    Fp8LinearFn,
    Fp8Options,
    Fp8Probe,
    InputNorms,
    LinearQuantSpec,
    fp8_linear,
)
from gnmr_dist.backends.fp8_scaling import (
    AMAX_ALGOS,
    AmaxHistory,
    DelayedRecipe,
    DelayedScales,
    amax_of,
    commit_all,
    scale_of,
)
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.numerics.scaled import quantize_dequantize_scaled
from gnmr_dist.backends.registry import register_backend

__all__ = [
    "AMAX_ALGOS",
    "SCALINGS",
    "AmaxHistory",
    "DelayedRecipe",
    "DelayedScales",
    "Fp8Call",
    "Fp8EmulatedBackend",
    "Fp8LinearFn",
    "Fp8Options",
    "LinearQuantSpec",
    "commit_all",
    "fp8_linear",
]

logger = logging.getLogger(__name__)


@register_backend("fp8_emulated")
class Fp8EmulatedBackend(PrecisionBackend):
    """Emulated FP8/FP6 GEMMs on the low-cost path, bf16 (or any format) on recovery.

    Options: ``low_cost`` / ``recovery`` blocks of :class:`Fp8Options`; defaults
    ``{"format": "e4m3"}`` (1x128 / 128x128 block scales) and ``{"format": "bf16"}``. A path with
    ``"scaling": "delayed"`` keeps amax histories per operator (module docstring).

    ``"gnmr"``::

        {"backend": "fp8_emulated", "low_cost": {"format": "e4m3"},
         "recovery": {"format": "bf16"}, "max_active": 4}
    """

    reports_errors = True
    adapted_gemms = True
    LowCost = Fp8Options
    Recovery = Fp8Options
    recovery_defaults: ClassVar[Mapping[str, Any]] = {"format": "bf16"}
    low_cost: Fp8Options
    recovery: Fp8Options

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
        another path inside uses a stand-in history there (module docstring)."""
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

        def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            probe, record = None, not self._measuring
            scales = self._scales_now(op, path, path_scales)
            key = self._call_key(op)
            seed = sr_seed(spec.seed, *key)
            if weight.requires_grad and not low.is_identity:
                probe = self._probe(x)
            if path == LOW_COST and probe is not None:
                return Fp8Call(spec, probe, scales, record, seed)(x, weight, bias)
            if spec.is_identity:
                y = F.linear(x, weight, bias)
            else:
                y = Fp8Call(spec, scales=scales, record=record, seed=seed)(x, weight, bias)
            if probe is not None and y.requires_grad:
                self._shadow(probe, x, y, low_scales, sr_seed(low.seed, *key))
            return y

        return gemm

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

    def _probe(self, x: torch.Tensor) -> Fp8Probe | None:
        """A probe for the running unit, sharing ``x``'s norms with the last GEMM of the same
        ``x`` (one slot keyed on its identity and version, as ``act_quant``'s shared pack)."""
        base = self._error_probe()
        if base is None:
            return None
        if self.specs[LOW_COST].delayed is not None:  # each operator has its own x scale
            return Fp8Probe(base.sink, base.unit)
        ref, version, shared = self._last_input
        if ref is None or ref() is not x or version != x._version:
            shared = InputNorms()
            self._last_input = (weakref.ref(x), x._version, shared)
        return Fp8Probe(base.sink, base.unit, shared=shared)

    def _shadow(
        self,
        probe: Fp8Probe,
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
        dy_seed = Fp8Call(low, seed=seed).seed_of(1)

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
