"""What every framework integration holds: the runtime, the backend and the skipped-step count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gnmr_dist.backends import PrecisionBackend
from gnmr_dist.core import Decision, GNMRController
from gnmr_dist.distributed import GNMRRuntime, Plan

__all__ = ["IntegrationSession"]


class IntegrationSession:
    """Base of ``engine.gnmr`` (DeepSpeed) and ``megatron_patches.current()`` (megatron-core)."""

    runtime: GNMRRuntime
    backend: PrecisionBackend | None
    skipped: int

    @property
    def controller(self) -> GNMRController:
        """The controller (identical on every rank)."""
        return self.runtime.controller

    @property
    def plan(self) -> Plan:
        """The plan the current step runs with."""
        return self.runtime.plan

    @property
    def last_decision(self) -> Decision | None:
        """The decision of the last applied optimizer step."""
        return self.runtime.last_decision

    def _apply_plan(self) -> None:
        if self.backend is not None:
            self.backend.apply(self.runtime.plan.active, self.runtime.plan.step)

    def state_dict(self) -> dict[str, Any]:
        """Controller state, unit names, plan and skipped-step count (plain, rank-identical,
        ``weights_only``-safe)."""
        return {**self.runtime.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (any parallel layout) and apply the restored plan."""
        self.runtime.load_state_dict(state)
        self.skipped = int(state.get("skipped", 0))
        self._apply_plan()
