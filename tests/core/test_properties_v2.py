"""Property tests of the second policy (docs/algorithm.md#properties) on random traces.

Scenarios draw budget schedules on both clocks, ``max_share`` with integer costs, ``latch``,
``pinned`` (``"all"`` or a mask) with its condition, thresholds with ``from`` and the ``step``
shape, and a learning-rate trace; the controller is compared decision for decision with the
naive ``tests/core/reference.py`` and every invariant the doc lists is checked at every step.
"""

from __future__ import annotations

import io
from fractions import Fraction

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gnmr_dist import GNMRConfig, GNMRController
from tests.core.reference import RefController, ref_threshold
from tests.core.test_properties import norm_value, same_floats

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

shape = st.sampled_from(["constant", "linear", "cosine", "step"])
step_clock = st.fixed_dictionaries(
    {"steps": st.integers(min_value=1, max_value=12)},
    optional={"from": st.integers(min_value=1, max_value=20)},
)


@st.composite
def lr_clock(draw):
    p = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5]))
    q = draw(st.sampled_from([0.5, 0.75, 0.9, 1.0]).filter(lambda x: x > p))
    out = {"clock": "lr_decay"}
    if p or draw(st.booleans()):
        out["from"] = p
    if q < 1 or draw(st.booleans()):
        out["to"] = q
    return out


def schedule(low, high):
    values = st.floats(min_value=low, max_value=high)
    return st.builds(
        lambda kind, a, b, clock: {"schedule": kind, "start": a, "end": b, **clock},
        shape,
        values,
        values,
        st.one_of(step_clock, lr_clock()),
    )


condition = st.one_of(
    st.fixed_dictionaries({"step": st.integers(min_value=1, max_value=30)}),
    st.fixed_dictionaries({"lr_decay": st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0])}),
)
lr_value = st.one_of(st.floats(min_value=0.0, max_value=1.0), st.just(0.0), st.just(1.0))


@st.composite
def scenarios(draw):
    u = draw(st.integers(min_value=1, max_value=6))
    t = draw(st.integers(min_value=1, max_value=30))
    cfg = {
        "max_active": draw(
            st.one_of(st.integers(min_value=0, max_value=u + 1), schedule(0.0, u + 1.5))
        ),
        "lock_steps": draw(st.integers(min_value=0, max_value=6)),
        "window": draw(st.integers(min_value=1, max_value=6)),
        "alpha": draw(st.one_of(st.floats(min_value=0.25, max_value=5.0), schedule(0.25, 5.0))),
        "beta": draw(st.floats(min_value=0.25, max_value=5.0)),
        "warmup_steps": draw(st.integers(min_value=0, max_value=5)),
    }
    extra = {
        "max_share": st.one_of(st.floats(min_value=0.0, max_value=1.0), schedule(0.0, 1.0)),
        "latch": condition,
        "pinned": st.builds(
            lambda units, first: {"units": units, **first},
            st.sampled_from(["all", ["unit.*"]]),
            st.one_of(st.just({}), st.builds(lambda c: {"from": c}, condition)),
        ),
    }
    for key, values in extra.items():
        if draw(st.booleans()):
            cfg[key] = draw(values)
    eligible = draw(st.lists(st.booleans(), min_size=u, max_size=u))
    mask = None
    if "pinned" in cfg and cfg["pinned"]["units"] != "all":
        mask = draw(st.lists(st.booleans(), min_size=u, max_size=u))
    costs = total = None
    if "max_share" in cfg or draw(st.booleans()):
        costs = draw(st.lists(st.integers(min_value=1, max_value=20), min_size=u, max_size=u))
        total = sum(costs) * draw(st.sampled_from([1, 2, 3]))
    trace = draw(st.lists(st.lists(norm_value, min_size=u, max_size=u), min_size=t, max_size=t))
    lrs = draw(st.lists(lr_value, min_size=t, max_size=t))
    units = {"eligible": eligible, "pinned": mask, "costs": costs, "total": total}
    return u, cfg, units, trace, lrs


def controller(u, cfg, units):
    return GNMRController(
        u,
        GNMRConfig.from_dict(cfg),
        eligible=units["eligible"],
        costs=units["costs"],
        total_cost=units["total"],
        pinned=units["pinned"],
    )


def run(u, cfg, units, trace, lrs):
    ctrl = controller(u, cfg, units)
    return ctrl, [ctrl.step(row, lr=lr) for row, lr in zip(trace, lrs, strict=True)]


@SETTINGS
@given(scenarios())
def test_matches_independent_reference_exactly(case):
    u, cfg, units, trace, lrs = case
    ctrl = controller(u, cfg, units)
    ref = RefController(
        u,
        eligible=units["eligible"],
        pinned_mask=units["pinned"],
        costs=units["costs"],
        total_cost=units["total"],
        **cfg,
    )
    for row, lr in zip(trace, lrs, strict=True):
        d, r = ctrl.step(row, lr=lr), ref.step(row, lr=lr)
        assert (d.step, d.active, d.candidates) == (r["step"], r["active"], r["candidates"])
        assert (d.chosen, d.pinned) == (r["chosen"], r["pinned"])
        assert same_floats(d.risk, r["risk"]) and same_floats(d.gnmr, r["gnmr"])
        assert ctrl.locks.tolist() == r["lock"] and ctrl.latches.tolist() == r["latched"]
        tele = d.telemetry.as_dict()
        if not isinstance(cfg["max_active"], int):
            assert tele["budget"] == r["k"]
        assert ("num_pinned" in tele) == ("pinned" in cfg)
        assert ("num_latched" in tele) == ("latch" in cfg)
    assert ctrl.recovered.tolist() == ref.recovered
    assert ctrl.nonfinite.tolist() == ref.nonfinite
    assert ctrl.first_nonfinite == ref.first_nonfinite


def share_cap(cfg, t, d):
    spec = cfg["max_share"]
    value = spec if not isinstance(spec, dict) else ref_threshold(spec, t, d)
    return Fraction(repr(float(value)))


@SETTINGS
@given(scenarios())
def test_budgets_plan_and_holders(case):
    u, cfg, units, trace, lrs = case
    config = GNMRConfig.from_dict(cfg)
    ctrl = controller(u, cfg, units)
    eligible, costs = units["eligible"], units["costs"]
    peak, plans = 0.0, []
    for row, lr in zip(trace, lrs, strict=True):
        d = ctrl.step(row, lr=lr)
        peak = max(peak, lr)
        decay = 1.0 - lr / peak if peak > 0 else 0.0
        k = config.budget_at(d.step, decay)
        chosen, pinned = set(d.chosen), set(d.pinned)
        # |A_t| <= k_t; cost(A_t) <= s_t W; R_t = A_t + P_t, disjoint; A_t within C
        assert len(chosen) <= k
        if "max_share" in cfg:
            spent = sum(costs[i] for i in chosen)
            assert spent <= share_cap(cfg, d.step, decay) * units["total"]
        assert set(d.active) == chosen | pinned and not chosen & pinned
        assert chosen <= set(d.candidates) and not pinned & set(d.candidates)
        assert all(eligible[i] for i in d.active)
        # P_t is every eligible pinned unit while the condition holds, else empty
        pin_now = config.pinned is not None and config.pinned.condition.holds(d.step, decay)
        mask = units["pinned"] or [True] * u
        want = {i for i in range(u) if pin_now and mask[i] and eligible[i]}
        assert pinned == want
        # lock and latch holders are chosen units, at most k_t of them
        holders = set((ctrl.locks > 0).nonzero().flatten().tolist())
        holders |= set((ctrl.latches > 0).nonzero().flatten().tolist())
        assert holders <= chosen and len(holders) <= k
        assert d.telemetry.num_active == len(d.active) and ctrl.plan == d.active
        if costs is not None:
            share = sum(costs[i] for i in d.active) / units["total"]
            assert d.telemetry.plan_share == share
        plans.append(d.active)
    # recovered(u) counts u's steps in R_{t-1}, so the last plan is not counted yet
    counted = [sum(i in p for p in plans[:-1]) for i in range(u)]
    assert ctrl.recovered.tolist() == counted


@SETTINGS
@given(scenarios())
def test_latched_unit_stays_in_the_plan_under_a_constant_budget(case):
    u, cfg, units, trace, lrs = case
    cfg = {**cfg, "latch": {"step": 1}}
    cfg["max_active"] = cfg["max_active"] if isinstance(cfg["max_active"], int) else 2
    if isinstance(cfg.get("max_share"), dict):
        cfg["max_share"] = 0.5
    if "pinned" in cfg:
        cfg["pinned"] = {"units": cfg["pinned"]["units"]}  # pinned from step 1: a fixed P
    _, ds = run(u, cfg, units, trace, lrs)
    for t, d in enumerate(ds):
        for unit in set(d.chosen) & {i for i in range(u) if bool(d.exceed[i])}:
            assert all(unit in later.chosen for later in ds[t + 1 :])


@SETTINGS
@given(scenarios(), st.integers(min_value=0, max_value=30))
def test_save_restore_mid_run_gives_uninterrupted_decisions(case, cut):
    u, cfg, units, trace, lrs = case
    cut = min(cut, len(trace))
    whole, full = run(u, cfg, units, trace, lrs)
    first = controller(u, cfg, units)
    for row, lr in zip(trace[:cut], lrs[:cut], strict=True):
        first.step(row, lr=lr)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = controller(u, cfg, units)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for row, lr, want in zip(trace[cut:], lrs[cut:], full[cut:], strict=True):
        got = resumed.step(row, lr=lr)
        assert (got.step, got.active, got.chosen, got.pinned) == (
            want.step,
            want.active,
            want.chosen,
            want.pinned,
        )
        assert got.telemetry == want.telemetry
        assert torch.equal(got.risk, want.risk)
    for name in ("recovered", "nonfinite", "latches", "locks"):
        assert torch.equal(getattr(resumed, name), getattr(whole, name)), name
    assert resumed.first_nonfinite == whole.first_nonfinite and resumed.plan == whole.plan


@SETTINGS
@given(scenarios())
def test_absent_keys_and_a_constant_budget_are_the_first_policy_bit_for_bit(case):
    u, cfg, units, trace, lrs = case
    plain = {k: v for k, v in cfg.items() if k not in ("max_share", "latch", "pinned")}
    k = plain["max_active"] if isinstance(plain["max_active"], int) else 2
    plain["max_active"] = k
    eligible = units["eligible"]
    base = GNMRController(u, GNMRConfig.from_dict(plain), eligible=eligible)
    nulls = {**plain, "max_share": None, "latch": None, "pinned": None}
    explicit = GNMRController(u, GNMRConfig.from_dict(nulls), eligible=eligible)
    const = {"schedule": "constant", "start": k + 0.5, "end": 0.0, "steps": 1}
    budget = GNMRController(u, GNMRConfig.from_dict({**plain, "max_active": const}), eligible)
    # a share of 1 with W = sum(w) never binds: the walk is the first k of the order
    everything = {"costs": [1] * u, "total_cost": u}
    loose = GNMRController(
        u, GNMRConfig.from_dict({**plain, "max_share": 1.0}), eligible, **everything
    )
    for row, lr in zip(trace, lrs, strict=True):
        # without the lr_decay clock base gets no lr, the others an lr they only track
        want = base.step(row, lr=lr if base.config.lr_keys() else None)
        for other in (explicit, budget, loose):
            got = other.step(row, lr=lr)
            assert (got.active, got.candidates) == (want.active, want.candidates)
            assert got.chosen == want.active and got.pinned == ()
            assert torch.equal(got.risk, want.risk) and torch.equal(got.gnmr, want.gnmr)
        assert want.telemetry.as_dict().keys() == {
            "num_exceed",
            "num_exceed_eligible",
            "num_candidates",
            "num_active",
            "num_locked",
            "num_nonfinite",
            "max_risk",
            "num_error_exceed",
        }
    # null is the default: the same config and the same JSON form as leaving the keys out
    assert explicit.config == base.config and explicit.config.to_dict() == base.config.to_dict()
    assert set(base.config.to_dict()) == set(plain)
