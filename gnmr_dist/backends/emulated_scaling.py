"""Delayed scaling (``"scaling": "delayed"``), Transformer Engine's ``DelayedScaling``, emulated.

Current scaling divides every tensor by its own ``amax / max_value``. Transformer Engine's
default recipe on Hopper scales by the past instead: every operator keeps, per GEMM input
(``x``, ``W``, ``dy``) and per path, the amaxes of its last ``H = amax_history_len`` steps, and
step t quantizes with

    a_t     = max(amax_{t-H}, ..., amax_{t-1})     ("max")   or   amax_{t-1}   ("most_recent")
    scale_t = a_t * 2^margin / max_value           (TE's scale is the inverse, fp8_max/a_t/2^m)
    Q(x)    = clamp(round(x / scale_t), +-max_value) * scale_t

(:func:`~gnmr_dist.backends.numerics.scaled.quantize_dequantize_scaled`). ``amax_t = max|x|``
over the step's calls joins the history when the next step's plan is applied. So a spike
(``amax_t >> a_t``) saturates at ``+-max_value * scale_t`` until it is in the history, and once
it is, its amax keeps the scale too large for up to H steps ("max"). Per-tensor scales only.

An empty history (first step, after a reset) scales each call by its own amax (current scaling,
margin included). A scale that is 0 or not finite falls back to 1 (TE keeps its previous
scale). When the histories are committed, reset or left alone (plan changes, steps run again,
the probe's passes) is the backend's choice (:mod:`gnmr_dist.backends.emulated`;
``docs/backends.md#delayed-scaling``).

Cost: per GEMM input one amax and one ``maximum``; per history and step one reduction over H
values (cached for the step) and, at ``apply``, one fused copy of all the step's amaxes; H floats
per history on the parameter's device. No host sync: amaxes and scales stay tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gnmr_dist.backends.emulated_options import DelayedRecipe, LinearQuantSpec
from gnmr_dist.backends.numerics.formats import FloatFormat
from gnmr_dist.backends.numerics.scaled import quantize_dequantize_scaled

__all__ = ["AmaxHistory", "DelayedScales", "amax_of", "commit_all", "scale_of"]


def scale_of(amax: torch.Tensor, fmt: FloatFormat, margin: int) -> torch.Tensor:
    """``amax * 2^margin / max_value`` (0-dim fp32), 1 where that is 0 or not finite.

    Divided first, as :func:`~gnmr_dist.backends.numerics.scaled.quantize_dequantize` does, so
    an empty history's scale equals current per-tensor scaling's bit for bit (``2^margin`` is
    exact).
    """
    scale = amax / fmt.max_value
    if margin:
        scale = scale * 2.0**margin
    return torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))


class AmaxHistory:
    """Delayed scaling of one GEMM input (one of x / W / dy of one operator on one path).

    A ring of the last H steps' amaxes (``[H]`` fp32 on the input's device, made at the first
    commit); :meth:`quantize` reads it, :meth:`commit` adds the finished step's amax (module
    docstring).
    """

    def __init__(self, fmt: FloatFormat, recipe: DelayedRecipe) -> None:
        self.fmt, self.recipe = fmt, recipe
        self.history: torch.Tensor | None = None
        """The ring buffer; entries ``[0, filled)`` are valid until it wraps."""
        self.filled = 0
        """Steps committed since the last reset, at most H (0: empty, use the call's amax)."""
        self.step_amax: torch.Tensor | None = None
        """Max ``|x|`` of this step's recorded calls, not yet committed (``None``: none ran)."""
        self._pos = 0
        self._scale: torch.Tensor | None = None  # this step's scale: the history is constant

    def quantize(self, t: torch.Tensor, *, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q(t), scale)`` with this step's delayed scale; ``record`` folds ``amax(t)`` into
        :attr:`step_amax`. An ``fp32`` input is returned as it is (its scale is 1)."""
        if self.fmt.is_identity:
            return t, torch.ones((), device=t.device)
        amax = amax_of(t) if record or self.filled == 0 else None
        scale = self.scale(amax)
        if record:
            assert amax is not None
            step = self.step_amax
            self.step_amax = amax if step is None else torch.maximum(step, amax)
        return quantize_dequantize_scaled(t, self.fmt, scale), scale

    def scale(self, amax: torch.Tensor | None = None) -> torch.Tensor:
        """This step's 0-dim scale: from the history, or from ``amax`` while it is empty."""
        if self.filled == 0:
            if amax is None:
                raise ValueError("an empty amax history needs the current amax to scale by")
            return scale_of(amax, self.fmt, self.recipe.margin)
        if self._scale is None:
            self._scale = scale_of(self._history_amax(), self.fmt, self.recipe.margin)
        return self._scale

    def _history_amax(self) -> torch.Tensor:
        """``a_t``: the max of the valid entries, or the most recent one."""
        assert self.history is not None
        if self.recipe.amax_compute_algo == "most_recent":
            return self.history[(self._pos - 1) % self.recipe.amax_history_len]
        return self.history[: self.filled].amax()

    def finite_step_amax(self) -> torch.Tensor:
        """:attr:`step_amax`, or where it is not finite the history's amax (0 when empty)."""
        assert self.step_amax is not None
        kept = self._history_amax() if self.filled else torch.zeros_like(self.step_amax)
        return torch.where(torch.isfinite(self.step_amax), self.step_amax, kept)

    def drop_step(self) -> None:
        """Forget this step's recorded amaxes (a step that is run again, or evaluation)."""
        self.step_amax = None

    def next_slot(self) -> torch.Tensor:
        """The 0-dim view :meth:`commit` writes :attr:`step_amax` into (history made here)."""
        assert self.step_amax is not None
        if self.history is None:
            h = self.recipe.amax_history_len
            self.history = torch.zeros(h, dtype=torch.float32, device=self.step_amax.device)
        return self.history[self._pos]

    def advance(self) -> None:
        """After :attr:`step_amax` was written into :meth:`next_slot`: a new step begins."""
        self._pos = (self._pos + 1) % self.recipe.amax_history_len
        self.filled = min(self.filled + 1, self.recipe.amax_history_len)
        self.step_amax, self._scale = None, None

    def commit(self) -> None:
        """Add this step's amax to the history (nothing when no call was recorded)."""
        commit_all([self])

    def reset(self) -> None:
        """Forget everything: the next call scales by its own amax."""
        self.filled, self._pos, self.step_amax, self._scale = 0, 0, None, None


def amax_of(t: torch.Tensor) -> torch.Tensor:
    """0-dim fp32 ``max |t|`` (0 for an empty tensor), on ``t``'s device."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float()


def commit_all(histories: Iterable[AmaxHistory]) -> None:
    """:meth:`AmaxHistory.commit` of many histories with one fused copy.

    A non-finite step amax (an overflowed step) is replaced by the history's current amax, so
    the scale stays what it was, as TE keeps its previous scale; no host sync decides it.
    """
    ran = [h for h in histories if h.step_amax is not None]
    if not ran:
        return
    amaxes = [h.finite_step_amax() for h in ran]
    torch._foreach_copy_([h.next_slot() for h in ran], amaxes)
    for h in ran:
        h.advance()


@dataclass
class DelayedScales:
    """One operator's delayed-scaling state on one path: a history per GEMM input."""

    x: AmaxHistory
    w: AmaxHistory
    dy: AmaxHistory

    @classmethod
    def of(cls, spec: LinearQuantSpec) -> DelayedScales:
        """Empty histories for ``spec`` (a delayed spec)."""
        if spec.delayed is None:
            raise ValueError("DelayedScales.of needs a spec with delayed scaling")
        r = spec.delayed
        x, w, dy = (AmaxHistory(f, r) for f in (spec.x_format, spec.x_format, spec.grad_format))
        return cls(x, w, dy)

    @property
    def histories(self) -> tuple[AmaxHistory, AmaxHistory, AmaxHistory]:
        """``(x, w, dy)``."""
        return self.x, self.w, self.dy

    def reset(self) -> None:
        """Reset the three histories (the next call of each scales by its own amax)."""
        for h in self.histories:
            h.reset()
