"""The recovery-gap probe: what the low-cost path does to each unit's gradient, measured.

On a *probe step* two extra forward/backward passes run through the backend's own switch, on the
step's own weights and batch:

    pass L: plan = {}                 (every unit on the low-cost path)   -> g_low
    pass H: plan = all eligible units (every unit on the recovery path)   -> g_high

    gap_u         = || g_low,u - g_high,u ||_2
    update_gap_u  = || (g_low,u - g_high,u) / (sqrt(v_hat_u) + eps) ||_2      (elementwise /)

``v_hat = exp_avg_sq / (1 - beta2^step)`` is Adam's bias-corrected second moment before this
step (``g_high^2`` on the first step; no normalisation for optimizers without ``betas``/``eps``).
Both passes start from the same RNG state and leave the RNG, the plan, ``.grad`` and the
backend's step report as they were. Per-unit sums of squares add over shards, so the ``4 x U``
vector (gap, update gap, low norm, high norm) is summed over ``group`` in one all-reduce; with
``dp_group`` the two gradients are first summed over the data-parallel replicas.

docs/telemetry.md#the-recovery-gap-probe has the why of each choice and the cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gnmr_dist.distributed.comm import Group, all_reduce_sum
from gnmr_dist.distributed.monitor import IndexCache, sum_of_squares_by_slot
from gnmr_dist.distributed.units import UnitRegistry

__all__ = ["ProbeResult", "RecoveryProbe", "SwitchableBackend"]

_LOW_COST, _RECOVERY = "low_cost", "recovery"  # the path names of gnmr_dist.backends.base


class _Report(Protocol):
    @property
    def step(self) -> int: ...
    @property
    def planned(self) -> frozenset[int]: ...
    @property
    def ran(self) -> Mapping[int, frozenset[str]]: ...


class SwitchableBackend(Protocol):
    """What the probe uses of a precision backend (:class:`gnmr_dist.backends.PrecisionBackend`
    declares all three). ``measuring()`` is entered around the probe's passes and its restoring
    ``apply``: state that training passes update is read but not updated inside."""

    def apply(self, active: Iterable[int], step: int) -> None: ...
    def report(self) -> _Report: ...
    def measuring(self) -> contextlib.AbstractContextManager[None]: ...


@dataclass(frozen=True)
class ProbeResult:
    """One probe step's measurements, identical on every rank of the probe's groups."""

    step: int
    """The optimizer step the backend's plan was applied for."""
    grad_gap: torch.Tensor
    """float64 [U]: ``||g_low,u - g_high,u||``."""
    update_gap: torch.Tensor
    """float64 [U]: ``||(g_low,u - g_high,u) / (sqrt(v_hat) + eps)||``."""
    grad_low_norm: torch.Tensor
    """float64 [U]: ``||g_low,u||``, every unit on the low-cost path."""
    grad_high_norm: torch.Tensor
    """float64 [U]: ``||g_high,u||``, every eligible unit on the recovery path."""
    loss_low: float
    """This rank's closure loss with every unit on the low-cost path."""
    loss_high: float
    """This rank's closure loss with every eligible unit on the recovery path."""


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    initialised = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = torch.cuda.get_rng_state_all() if initialised else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class RecoveryProbe:
    """Measures every unit's recovery gap on demand (see the module docstring for the maths).

    Args:
        registry: the model's units; the probe differentiates this rank's counted parameters of
            every unit that require a gradient (a LoRA unit: its adapters).
        backend: the backend that wrapped the registry's local modules.
        optimizer: the optimizer whose per-parameter normalisation the update gap applies
            (Adam/AdamW or any optimizer with Adam's ``exp_avg_sq``/``betas``/``eps``); ``None``:
            none (update gap = gradient gap).
        group: ranks across which the units' gradient *elements* are split (tensor x pipeline,
            as the monitor's); ``None``: no communication.
        dp_group: data-parallel replicas, each holding the gradient of part of the batch;
            ``None``: this rank's closure sees the whole batch.
    """

    def __init__(
        self,
        registry: UnitRegistry,
        backend: SwitchableBackend,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        group: Group | None = None,
        dp_group: Group | None = None,
    ) -> None:
        self.registry, self.backend, self.optimizer = registry, backend, optimizer
        self.group, self.dp_group = group, dp_group
        u = registry.num_units
        pairs = [
            (p, s)
            for p, s in zip(registry.params, registry.param_slots.tolist(), strict=True)
            if s < u and p.requires_grad
        ]
        self.params = [p for p, _ in pairs]
        self._slots = [s for _, s in pairs]
        self._recover_all = tuple(int(i) for i in torch.nonzero(registry.eligible).flatten())
        self._device = self.params[0].device if self.params else torch.device("cpu")
        self._index_cache: IndexCache = {}

    def measure(self, closure: Callable[[], torch.Tensor]) -> ProbeResult:
        """Run the two passes of ``closure`` and return every unit's gaps.

        ``closure()`` runs the step's forward (inside any context the step's own forward needs,
        e.g. the backend's ``step_context()``) on the step's batch and returns its scalar loss.
        Call ``measure`` after the backend's ``apply`` for the step and before the step's own
        forward: the backend's report must still be empty so that re-applying the plan restores
        it exactly. Activation checkpointing must be non-reentrant (``torch.autograd.grad``).
        """
        before = self.backend.report()
        if before.ran:
            raise RuntimeError(
                f"RecoveryProbe.measure at step {before.step}: units {sorted(before.ran)} already "
                "ran a forward since the backend's apply(); call measure() after apply() and "
                "before the step's own forward, so that its plan and report can be restored"
            )
        # both passes see the same dropout masks: the gap is the numerics' alone
        rng = _rng_state()
        with self.backend.measuring():
            try:
                low, loss_low = self._pass(closure, (), before.step, rng)
                high, loss_high = self._pass(closure, self._recover_all, before.step, rng)
            finally:
                # the step's own plan back, whatever the passes did
                self.backend.apply(before.planned, before.step)
                _set_rng_state(rng)
        if self.dp_group is not None:
            # each replica saw its own micro-batch: the step's gradient is their sum
            low, high = self._sum_over_replicas(low, high)
        return self._result(before.step, low, high, loss_low, loss_high)

    def _pass(
        self,
        closure: Callable[[], torch.Tensor],
        plan: Sequence[int],
        step: int,
        rng: tuple[torch.Tensor, list[torch.Tensor] | None],
    ) -> tuple[list[torch.Tensor], float]:
        """Gradients of the units' parameters with ``plan`` forced (zeros where unused)."""
        self.backend.apply(plan, step)
        _set_rng_state(rng)
        with torch.enable_grad():
            loss = closure()
            params = self.params  # a rank holding no unit (an embedding-only stage) has none
            grads = torch.autograd.grad(loss, params, allow_unused=True) if params else ()
        self._check_paths(_RECOVERY if plan else _LOW_COST)
        self._check_reached(grads)
        out = [
            torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads, strict=True)
        ]
        return out, float(loss.detach())

    def _check_reached(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Every unit that ran a forward in the pass got a gradient: reentrant activation
        checkpointing (``torch.utils.checkpoint(use_reentrant=True)``, Hugging Face's default
        for ``gradient_checkpointing_enable()``, DeepSpeed's own) hides the checkpointed
        parameters from ``torch.autograd.grad``, which would read as zero gaps."""
        reached = {s for s, g in zip(self._slots, grads, strict=True) if g is not None}
        held = set(self._slots)
        missed = sorted(u for u in self.backend.report().ran if u in held and u not in reached)
        if missed:
            names = [self.registry.names[u] for u in missed[:3]]
            raise RuntimeError(
                f"RecoveryProbe: units {names} ran a forward but torch.autograd.grad reached none "
                "of their parameters; with activation checkpointing use the non-reentrant form "
                "(use_reentrant=False; Hugging Face: gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})) or drop gnmr.probe"
            )

    def _check_paths(self, want: str) -> None:
        """Every forward of the pass ran ``want`` (an eligible unit on it, at least)."""
        eligible = set(self._recover_all)
        wrong = sorted(
            u
            for u, paths in self.backend.report().ran.items()
            if (want == _LOW_COST and _RECOVERY in paths)
            or (want == _RECOVERY and u in eligible and _LOW_COST in paths)
        )
        if wrong:
            raise RuntimeError(
                f"RecoveryProbe: units {wrong} did not run the {want} path during its pass; "
                "something changed the backend's plan inside the closure (a lazy before_forward "
                "hook?)"
            )

    def _sum_over_replicas(
        self, low: list[torch.Tensor], high: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``g_low`` and ``g_high`` summed over ``dp_group``: one flat all-reduce."""
        tensors = low + high
        if not tensors:
            return low, high
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        # one flat all-reduce for every tensor of both passes, in their common dtype
        flat = all_reduce_sum(torch.cat([t.reshape(-1).to(dtype) for t in tensors]), self.dp_group)
        parts = [
            p.view_as(t)
            for p, t in zip(torch.split(flat, [t.numel() for t in tensors]), tensors, strict=True)
        ]
        return parts[: len(low)], parts[len(low) :]

    def _result(
        self,
        step: int,
        low: list[torch.Tensor],
        high: list[torch.Tensor],
        loss_low: float,
        loss_high: float,
    ) -> ProbeResult:
        diff = torch._foreach_sub(low, high) if low else []
        scaled = [
            d if den is None else d / den
            for d, den in zip(diff, self._denominators(high), strict=True)
        ]
        u = self.registry.num_units
        sums = torch.stack(
            [
                sum_of_squares_by_slot(ts, self._slots, u, self._device, self._index_cache)
                for ts in (diff, scaled, low, high)
            ]
        )
        norms = all_reduce_sum(sums, self.group).cpu().sqrt()
        return ProbeResult(step, norms[0], norms[1], norms[2], norms[3], loss_low, loss_high)

    def _denominators(self, high: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per parameter ``sqrt(v_hat) + eps`` (Adam-like groups), else ``None`` (identity)."""
        if self.optimizer is None:
            return [None] * len(high)
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        return [
            _adam_denominator(g, groups.get(id(p)), self.optimizer.state.get(p, {}))
            for p, g in zip(self.params, high, strict=True)
        ]


def _adam_denominator(
    g_high: torch.Tensor, group: Mapping[str, Any] | None, state: Mapping[str, Any]
) -> torch.Tensor | None:
    if group is None or "betas" not in group or "eps" not in group:
        return None
    v = state.get("max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq")
    if v is None:  # first step: Adam's v_hat_1 = g^2
        v_hat = g_high.square()
    else:
        v_hat = v.to(g_high.dtype) / (1.0 - float(group["betas"][1]) ** float(state["step"]))
    return v_hat.sqrt_().add_(float(group["eps"]))
