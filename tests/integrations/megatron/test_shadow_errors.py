"""The shadow error route under megatron-core TP2 with sequence parallelism, real processes.

``fp8_emulated`` measures ``B(u)`` inside its wgrad GEMM; a subclass also hands every GEMM call
(the operands megatron's tensor-parallel adapters give it: the all-gathered sequence for a
column-parallel linear, the local shard for a row-parallel one) to the shadow route with the
backend's own quantization. Over three training steps of megatron's own schedule (micro-batches,
``finalize_model_grads``) both sums must be equal bit for bit on every rank, low-cost and
recovered units alike, and the reduced vector the controller scores must be what the route's
local sums reduce to.
"""

from __future__ import annotations

import pytest
import torch

from tests import multiproc
from tests.requires import require

require("megatron.core")

BLOCK = {
    "backend": "test_emulated_shadowed",
    "units": "operator",
    "gamma": 0.05,
    "max_active": 2,
    "warmup_steps": 0,
    "alpha": 100.0,
    "beta": 100.0,
    "low_cost": {"grad_format": "e5m2"},
}
"""Default 1 x 128 e4m3 tiles, e5m2 gradients; only ``e`` can select a unit (``alpha`` and
``beta`` out of reach)."""


def _register():
    from gnmr_dist.backends import LOW_COST, register_backend
    from gnmr_dist.backends.emulated import EmulatedBackend
    from gnmr_dist.backends.error_sums import ErrorSums
    from gnmr_dist.backends.shadow import ShadowRoute, SpecRecipe

    class Shadowed(EmulatedBackend):
        """``fp8_emulated`` whose every GEMM call is also measured by the shadow route."""

        def track_errors(self, num_units, every=1):
            super().track_errors(num_units, every)
            self.sink = ErrorSums(num_units)
            self.route = ShadowRoute(SpecRecipe(self.specs[LOW_COST]))

        def apply(self, active, step):
            super().apply(active, step)
            self.sink.reset()

        def make_gemm(self, op, path):
            gemm = super().make_gemm(op, path)

            def run(x, weight, bias):
                measured = self._error_probe() is not None and weight.requires_grad
                y = gemm(x, weight, bias)
                if measured:
                    self.route.measure(self.sink, self._unit, x, y)
                return y

            return run

    register_backend("test_emulated_shadowed")(Shadowed)


def _worker(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import megatron_patches
    from tests.integrations.megatron import settings

    _register()
    setting = settings.SETTINGS_BY_NAME["tp2-sp"]
    chunks, opt, handle = settings.patched(setting, BLOCK)
    backend, cpu = handle.backend, torch.device("cpu")
    out = []
    for step in range(3):
        settings.train_step(chunks, step)
        own, shadow = backend.error_sums(cpu), backend.sink.total(cpu)
        recovered = sorted(backend.report().recovered)
        opt.step()
        scale = handle.runtime.monitor.error_scale  # what the session does to the backend's sums
        reduced = (shadow * scale / handle._loss_scale(cpu)).float()
        dist.all_reduce(reduced, group=ps.get_model_parallel_group())
        decision = handle.last_decision  # megatron's decision is taken lazily: take it now
        norms = handle.runtime.last_norms
        out.append(
            {
                "own": own,
                "shadow": shadow,
                "reduced": reduced,
                "scored": norms.error_sums,
                "active": decision.active,
                "error": decision.error,
                "recovered": recovered,
            }
        )
    megatron_patches.disable()
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_shadow_route_equals_the_emulated_backends_sums_under_tp2_sequence_parallel():
    ranks = multiproc.run(_worker, 2)
    for r in ranks:
        for step in r:
            assert (step["own"] > 0).any()
            assert torch.equal(step["own"], step["shadow"])
    for a, b in zip(*ranks, strict=True):  # the reduced score is the same on both TP ranks
        assert torch.equal(a["scored"], b["scored"]) and a["active"] == b["active"]
        assert torch.equal(a["scored"].float(), a["reduced"])
    assert any(s["active"] for s in ranks[0])  # e drove a selection...
    assert any(s["recovered"] for s in ranks[0][1:])  # ...and the shadow measured it recovered
