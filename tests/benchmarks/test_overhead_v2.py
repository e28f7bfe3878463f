"""benchmarks/overhead/gemm_subset.py and controller.py (issue 34's cost): tiny runs, their result
files' structure and invariants. Never a timing threshold: the figures come from the full runs.

The GEMM-subset study must replay exactly GNMR's plan (the same weights at the end, the same
recovered units every step), and the decision study must decide as the numpy twin and hold the
second policy's budgets (its checker is tested to catch a breach).
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from benchmarks.harness.arms import Setup
from benchmarks.harness.model import Batches
from benchmarks.overhead import controller as oc
from benchmarks.overhead import gemm_subset as gs
from benchmarks.overhead.step_time import interleave

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/benchmarks/conftest.py

TINY = {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "seq_len": 16, "batch": 2}
TINY_SETUP = {**TINY, "max_bytes": 30_000}
ACTIVE = {"warmup_steps": 0, "alpha": 1.0, "beta": 1.0}
"""A GNMR policy that recovers from the first steps on (the tiny run has no time to warm up)."""


@pytest.fixture(scope="module")
def subset_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("v2") / "overhead_v2.json"
    argv = ["--steps", "3", "--warm", "1", "--repeats", "2", "--budget", "2", "--threads", "1"]
    argv += ["--setup", json.dumps(TINY_SETUP), "--gnmr", json.dumps(ACTIVE), "--out", str(out)]
    returned = gs.main(argv)
    return returned, json.loads(out.read_text())


def test_replayed_arms_run_gnmrs_plan_and_train_identically():
    setup = Setup(**TINY_SETUP)
    options = {"low_cost": gs.FORMATS["e4m3"], "recovery": {"format": "bf16"}}
    arms = gs.build_arms(options, setup, {**ACTIVE, "max_active": 2})
    gnmr, plain, null, whole = arms
    assert gnmr.backend.gemms == plain.backend.gemms == null.backend.gemms == frozenset(gs.SUBSET)
    assert len(whole.backend.gemms) == 3
    interleave(arms, Batches(setup.data, setup), steps=4, warm=1)
    assert any(gnmr.plans.values()), "the tiny policy must recover some unit"
    # every arm ran the plan GNMR chose, step by step (the backend's own count)
    assert gnmr.timings.active == plain.timings.active == null.timings.active
    assert whole.timings.active == gnmr.timings.active
    assert [len(gnmr.plans[s]) for s in range(2, 6)] == gnmr.timings.active
    for arm in arms:
        assert arm.backend.report().planned == gnmr.plans[5]
    assert gs.same_weights(gnmr.model, plain.model) and gs.same_weights(gnmr.model, null.model)
    assert not gs.same_weights(gnmr.model, whole.model)  # other numerics on recovered dgrad/wgrad
    # GNMR's own work is timed only where GNMR runs
    assert min(gnmr.timings.controller) > 0 and max(plain.timings.controller) == 0


def test_result_file_structure(subset_run):
    returned, saved = subset_run
    assert json.loads(json.dumps(returned)) == saved
    assert saved["target"] == gs.TARGET == 1.01
    assert saved["provenance"]["commit"] and "torch" in saved["provenance"]["versions"]
    assert saved["gnmr_policy"]["max_active"] == 2 and saved["gnmr_policy"]["alpha"] == 1.0
    assert saved["setup"]["hidden"] == 32
    assert [r["format"] for r in saved["results"]] == list(gs.FORMATS)
    for res in saved["results"]:
        assert res["gemms"] == ["fprop"]
        assert res["same_weights"] == [True, True]
        arms = {a["arm"]: a for a in res["arms"]}
        assert list(arms) == [gs.GNMR, gs.PLAIN, gs.NULL, gs.ALL]
        actives = {a["mean_active"] for a in arms.values()}
        assert len(actives) == 1 and actives.pop() > 0  # one plan, and a non-empty one
        assert arms[gs.GNMR]["controller_ms"] > 0 and arms[gs.PLAIN]["monitor_ms"] == 0
        own = arms[gs.GNMR]["monitor_ms"] + arms[gs.GNMR]["controller_ms"]
        assert res["own_fraction"] == pytest.approx(own / arms[gs.PLAIN]["cpu_ms"])
        assert arms[gs.GNMR]["own_wall_ms"] > 0
        wall = arms[gs.GNMR]["own_wall_ms"] / arms[gs.PLAIN]["wall_ms"]
        assert res["own_fraction_wall"] == pytest.approx(wall)
        # the raw rounds: one list per repeat, per arm and clock; the medians come from them
        raw = res["raw_ms"]
        assert set(raw) == set(arms) and all(len(raw[a]["cpu"]) == 2 for a in raw)
        assert all(len(rep) == 3 for a in raw for rep in raw[a]["wall"])
        pooled = sorted(x for rep in raw[gs.PLAIN]["cpu"] for x in rep)
        assert arms[gs.PLAIN]["cpu_ms"] == pytest.approx(sum(pooled[2:4]) / 2, abs=1e-3)
        pairs = {f"{arm} / {gs.PLAIN}" for arm in (gs.GNMR, gs.NULL, gs.ALL)}
        assert set(res["ratios"]) == pairs
        for pair in res["ratios"].values():
            for r in pair.values():
                lo, hi = r["ci95"]
                assert 0 < lo <= hi and r["rounds"] == 6 and len(r["repeat_medians"]) == 2
                assert r["repeat_min_max"] == [min(r["repeat_medians"]), max(r["repeat_medians"])]
        for kind, verdict in res["acceptance"].items():
            r = res["ratios"][f"{gs.GNMR} / {gs.PLAIN}"][kind]
            assert verdict == {"ratio": r["median"], "ci95": r["ci95"], "met": r["median"] <= 1.01}
        r = res["ratios"][f"{gs.GNMR} / {gs.PLAIN}"]["cpu"]
        assert r["ratio_of_medians"] == pytest.approx(
            arms[gs.GNMR]["cpu_ms"] / arms[gs.PLAIN]["cpu_ms"]
        )
    text = gs.table(saved["results"]) + "\n".join(gs.verdicts(saved["results"]))
    assert "target <= 1.01" in text and gs.GNMR in text


def test_median_interval_brackets_a_tight_sample():
    lo, hi = gs.median_interval([1.0] * 5 + [1.02] * 5 + [5.0])
    assert 1.0 <= lo <= hi <= 1.02  # the outlier moves the median's interval not at all
    assert gs.median_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)


def test_decision_study_rows_and_v2_features(tmp_path):
    out = tmp_path / "ctrl.json"
    saved = oc.main(["--units", "28", "200", "--steps", "120", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(saved))
    assert saved["provenance"]["commit"] and saved["matmul_1024_ms"] > 0
    assert [r["units"] for r in saved["rows"]] == [28, 200]
    for row in saved["rows"]:
        assert row["decisions_identical"] and row["v2_budgets_held"]
        for arm in oc.ARMS:
            assert 0 < row[f"{arm}_us"] <= row[f"{arm}_p90_us"]
        assert row["v2_over_off"] == pytest.approx(row["v2_us"] / row["off_us"])
        policy = row["v2_policy"]
        assert {"max_share", "latch", "pinned"} <= set(policy)
        assert policy["max_active"]["clock"] == "lr_decay"
        # the features were engaged: pinned units ran, units latched after half decay
        assert row["v2_mean_pinned"] > 0 and row["v2_latched_at_end"] > 0
    assert all(r["v2_mean_chosen"] > 0 for r in saved["rows"])
    assert any(r["v2_cap_bound_share"] > 0 for r in saved["rows"])  # the cost cap bound


def test_lr_trace_decays_past_the_latch_condition():
    lr = oc.lr_trace(100)
    assert lr.max() == pytest.approx(1e-3) and lr[-1] == pytest.approx(1e-4)
    assert 1 - lr[-1] / lr.max() >= 0.5  # the latch's {"lr_decay": 0.5} holds by the end


def test_v2_checker_catches_a_breached_budget():
    cfg, kwargs = oc.v2_setup(64, 40)
    k = oc.budget_of(64)
    pinned = np.flatnonzero(kwargs["pinned"]).tolist()

    def decision(chosen, pins, step=20, budget=k):
        tele = types.SimpleNamespace(budget=budget, num_candidates=10)
        return types.SimpleNamespace(step=step, chosen=chosen, pinned=pins, telemetry=tele)

    cheap = [int(np.argmin(kwargs["costs"]))]
    assert oc.check_v2(decision(cheap, pinned), cfg, kwargs, 40)[:2] == [1, len(pinned)]
    with pytest.raises(RuntimeError, match="budgets breached"):
        oc.check_v2(decision(list(range(k + 1)), pinned), cfg, kwargs, 40)  # over k_t
    costly = np.argsort(-kwargs["costs"])[:k].tolist()
    with pytest.raises(RuntimeError, match="budgets breached"):
        oc.check_v2(decision(costly, pinned, budget=k), cfg, kwargs, 40)  # over the cap
    with pytest.raises(RuntimeError, match="budgets breached"):
        oc.check_v2(decision(cheap, [], step=20), cfg, kwargs, 40)  # pinned units missing
    with pytest.raises(RuntimeError, match="budgets breached"):
        oc.check_v2(decision(cheap, pinned, step=2), cfg, kwargs, 40)  # pinned too early
