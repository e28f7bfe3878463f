"""A backend registered from outside ``gnmr_dist`` runs under DeepSpeed (real, 2 gloo ranks, CPU).

The backend (:mod:`tests.backends.external`) is registered by importing its module, as a user's
package would be, and selected by name in the ``"gnmr"`` block; the Megatron half is
``tests/integrations/megatron/test_external_backend.py``.
"""

from __future__ import annotations

import pytest

from tests.requires import require

require("deepspeed")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

BLOCK = {
    "backend": "test_rounded",
    "low_cost": {"mantissa_bits": 3},
    "max_active": 2,
    "lock_steps": 2,
    "warmup_steps": 3,
    "check_consistency": True,
}
SPIKE, STEPS = 6, 8


def _worker(rank, world):
    import dataclasses

    import gnmr_dist.deepspeed as gds
    from tests.backends import external  # the user's import: registers "test_rounded"

    dsc.no_shm_build()
    engine, *_ = gds.initialize(model=dsc.llama(), config=dsc.ds_config(2, "fp32", BLOCK))
    target = engine.module.model.layers[1].mlp.up_proj.weight
    reports = []
    for step in range(1, STEPS + 1):
        handle = target.register_hook(lambda g: g * 50) if step == SPIKE else None
        loss = engine(input_ids=dsc.batch(step, rank), labels=dsc.batch(step, rank)).loss
        reports.append(engine.gnmr.backend.report())
        engine.backward(loss)
        engine.step()
        if handle is not None:
            handle.remove()
    return {
        "class": type(engine.gnmr.backend).__qualname__,
        "options": dataclasses.asdict(engine.gnmr.backend.low_cost),
        "wrapped": len(engine.gnmr.backend.units),
        "units": engine.gnmr.registry.num_units,
        "names": engine.gnmr.registry.names,
        "reports": [(r.step, set(r.planned), set(r.recovered), set(r.low_cost)) for r in reports],
        "calls": dict(external.CALLS),
    }


def test_an_external_backend_runs_under_deepspeed():
    # (the backend is imported in the workers only: registered here it would join BACKENDS of
    # this process, which other tests check against the built-in list)
    results = multiproc.run(_worker, 2)
    for r in results:
        assert r["class"] == "RoundedBackend" and r["options"] == {"mantissa_bits": 3}
        assert r["wrapped"] == r["units"] == 14  # every projection of the 2-layer llama
        assert r["reports"] == results[0]["reports"]  # every rank ran the same plan
    reports = results[0]["reports"]
    unit = results[0]["names"].index("model.layers.1.mlp.up_proj")
    assert unit in reports[SPIKE][1] and unit in reports[SPIKE][2]  # planned and run at 7
    for step, planned, recovered, low in reports:
        assert recovered == planned and low == set(range(14)) - planned, step
    calls = results[0]["calls"]
    assert calls["recovery"] > 0 and calls["low_cost"] > 0
