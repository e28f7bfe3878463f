"""A backend registered from outside ``gnmr_dist`` runs under megatron-core (TP2, CPU, gloo).

:mod:`tests.backends.external` opts in to adapted operators (``adapted_gemms``), so it runs
megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` through the integration's
tensor-parallel adapter; with the recovery path on every unit the step is exactly megatron's own.
"""

from __future__ import annotations

import pytest

from tests.requires import require

require("megatron.core")

from tests import multiproc

pytestmark = pytest.mark.slow


def _worker(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import megatron_patches
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.backends import external  # the user's import: registers "test_rounded"
    from tests.integrations.megatron import gpt

    enable_cpu_compat()
    full, _ = gpt.full_reference(1)
    cfg = OptimizerConfig(optimizer="sgd", lr=0.05, clip_grad=1.0)
    plain = gpt.parallel_model(2, 1, full)
    plain_loss = gpt.train_step(plain, 1)
    ps.destroy_model_parallel()

    model = gpt.parallel_model(2, 1, full)
    opt = get_megatron_optimizer(cfg, [model])
    block = {"backend": "test_rounded", "max_active": 2, "warmup_steps": 2}
    handle = megatron_patches.enable(model, block, optimizer=opt)
    kinds = sorted({type(m).__name__ for m in handle.registry.local_modules.values()})
    handle.backend.apply(range(handle.registry.num_units), step=1)  # all on recovery
    recovered_loss = gpt.train_step(model, 1)
    recovered = handle.backend.report()
    handle.backend.apply((), step=2)  # all on the low-cost path
    low_loss = gpt.train_step(model, 1)
    low = handle.backend.report()
    wrapped = sorted(handle.backend.units)
    megatron_patches.disable()
    return {
        "class": type(handle.backend).__qualname__,
        "kinds": kinds,
        "units": handle.registry.num_units,
        "wrapped": wrapped,
        "losses": (float(plain_loss), float(recovered_loss), float(low_loss)),
        "recovered": (set(recovered.recovered), set(recovered.low_cost)),
        "low": (set(low.recovered), set(low.low_cost)),
        "calls": dict(external.CALLS),
    }


def test_an_external_backend_runs_under_megatron():
    results = multiproc.run(_worker, 2)
    for r in results:
        assert r["class"] == "RoundedBackend"
        assert r["kinds"] == ["ColumnParallelLinear", "RowParallelLinear"]
        assert r["wrapped"] == list(range(r["units"]))  # TP: every rank holds a shard of each
        everything = set(range(r["units"]))
        assert r["recovered"] == (everything, set()) and r["low"] == (set(), everything)
        plain, recovered, low = r["losses"]
        assert recovered == pytest.approx(plain, rel=1e-6)  # recovery = megatron's own GEMM
        assert abs(low - plain) > 1e-5  # 3-bit mantissas moved the loss (by about 6e-5)
        assert r["calls"]["low_cost"] > 0 and r["calls"]["recovery"] > 0
    assert results[0]["losses"] == pytest.approx(results[1]["losses"], rel=0, abs=0)
