"""docs/algorithm.md#damage-term in the runtime: error sums ride the norms' all-reduce, e = B /
G."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gnmr_dist import GNMRConfig
from gnmr_dist.distributed import GNMRRuntime, GradNormMonitor, UnitNorms, UnitRegistry
from tests import multiproc
from tests.distributed.test_monitor import layout_groups
from tests.distributed.toy import MARKS, Toy, full_model_with_grads, shard


def rank_errors(rank: int, units: int, step: int) -> torch.Tensor:
    """A rank's made-up local error sums: different on every rank and step, unit 3 large."""
    g = torch.Generator().manual_seed(100 * step + rank)
    b = torch.rand(units, generator=g, dtype=torch.float64)
    b[3] *= 50
    return b


def _reduce_worker(rank, world, steps):
    tp_group, tp_rank, _ = layout_groups(world, world)
    local = shard(full_model_with_grads(), world, tp_rank, 1, 0)
    reg = UnitRegistry.from_model(local, group=dist.group.WORLD, tp_group=tp_group, marks=MARKS)
    u = reg.num_units
    step = [0]

    def error_fn(device):
        return rank_errors(rank, u, step[0]).to(device)

    out = {}
    for gamma in (None, 0.5):
        cfg = GNMRConfig(warmup_steps=0, max_active=1, gamma=gamma)
        runtime = GNMRRuntime(
            reg, cfg, group=dist.group.WORLD, error_fn=error_fn, error_scale=1 / world
        )
        rows = []
        for t in range(1, steps + 1):
            step[0] = t
            with multiproc.CollectiveSpy(p2p=True) as spy:
                d = runtime.step()
            n = runtime.last_norms
            rows.append((spy.calls, n.global_norm, n.error_sums, d.error, d.active, d.risk))
        out[gamma] = rows
    return u, out


def test_one_all_reduce_carries_both_and_the_controller_gets_b_over_the_global_norm():
    world, steps = 2, 3
    results = multiproc.run(_reduce_worker, world, steps)
    for u, out in results:
        for calls, _, sums, error, _, _ in out[None]:
            assert calls == [("all_reduce", u + 1)]  # gamma unset: the vector of before
            assert sums is None and error is None
        for t, (calls, global_norm, sums, error, active, risk) in enumerate(out[0.5], start=1):
            assert calls == [("all_reduce", 2 * u + 1)]  # one collective, 2U + 1 values
            want = sum(rank_errors(r, u, t) for r in range(world)) / world  # sum x 1/dp
            assert torch.allclose(sums, want, rtol=1e-12, atol=0)
            assert torch.allclose(error, want / global_norm, rtol=1e-12, atol=0)
            assert torch.equal(risk, torch.maximum(risk, error / 0.5))
            assert active == (3,)  # the unit whose error is 50x the others'
    (_, a), (_, b) = results
    for ra, rb in zip(a[0.5], b[0.5], strict=True):  # every rank decides on the same vector
        assert torch.equal(ra[2], rb[2]) and torch.equal(ra[5], rb[5])


def _grads(model, t):
    g = torch.Generator().manual_seed(t)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * (1 + 4 * (t == 7))


def test_without_gamma_the_error_source_is_ignored_and_decisions_are_bit_identical():
    model = Toy()
    reg = UnitRegistry.from_model(model)
    cfg = GNMRConfig(warmup_steps=2, max_active=2)
    plain = GNMRRuntime(reg, cfg)
    fed = GNMRRuntime(reg, cfg, error_fn=lambda d: torch.ones(reg.num_units), error_scale=0.5)
    assert fed.monitor.error_fn is None and not fed.uses_errors
    for t in range(1, 12):
        _grads(model, t)
        a, b = plain.step(), fed.step()
        assert a.active == b.active and torch.equal(a.risk, b.risk) and b.error is None
        assert fed.last_norms.error_sums is None


def test_gamma_needs_an_error_source_that_reports():
    reg = UnitRegistry.from_model(Toy(layers=1))
    cfg = GNMRConfig(gamma=0.5)
    with pytest.raises(ValueError, match=r"gnmr\.gamma is set, so the runtime needs per-unit"):
        GNMRRuntime(reg, cfg)
    with pytest.raises(ValueError, match=r"gnmr\.gamma is set but the error source .* returned"):
        GNMRRuntime(reg, cfg, error_fn=lambda device: None)
    runtime = GNMRRuntime(reg, cfg, error_fn=lambda device: torch.zeros(reg.num_units))
    norms = torch.ones(reg.num_units, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"these norms carry no error sums"):
        runtime.observe(UnitNorms(norms, 1.0, 1.0))
    wrong = GNMRRuntime(reg, cfg, error_fn=lambda device: torch.zeros(reg.num_units + 1))
    with pytest.raises(ValueError, match=r"error_fn must return the float64 \[2\] error sums"):
        wrong.step()
    with pytest.raises(ValueError, match="error_scale must be a finite number > 0"):
        GradNormMonitor(reg, error_scale=0.0)


def test_relative_errors_and_the_fp16_loss_scale():
    n = torch.tensor([2.0, 0.0, 5.0, 1.0], dtype=torch.float64)  # the units' norms play no part
    b = torch.tensor([1.0, 0.0, 3.0, math.nan], dtype=torch.float64)
    e = UnitNorms(n, 0.0, 4.0, error_sums=b).relative_errors()
    assert e.tolist() == [0.25, 0.0, 0.75, math.inf]  # a non-finite B scores +inf
    e = UnitNorms(n, 0.0, 0.0, error_sums=b[:3]).relative_errors()  # G = 0
    assert e.tolist() == [math.inf, 0.0, math.inf]
    assert UnitNorms(n, 0.0, 0.0).relative_errors() is None
    # one unit's NaN gradient (G = NaN): the others are divided by the norm of the finite parts
    n_nan = torch.tensor([3.0, math.nan, 4.0], dtype=torch.float64)
    e = UnitNorms(n_nan, 0.0, math.nan, error_sums=torch.ones(3, dtype=torch.float64))
    assert e.relative_errors().tolist() == [0.2, 0.2, 0.2]

    model = full_model_with_grads()
    reg = UnitRegistry.from_model(model)
    sums = torch.arange(1.0, reg.num_units + 1, dtype=torch.float64)
    loss_scale = [1.0]  # B is linear in dy, which carries the loss scale
    monitor = GradNormMonitor(reg, error_fn=lambda device: sums * loss_scale[0], error_scale=0.25)
    clean = monitor.compute()
    loss_scale[0] = 8.0
    for p in model.parameters():
        p.grad.mul_(8.0)  # an fp16 loss scale of 8 on the gradients and on every dy
    scaled = monitor.start(grad_scale=8.0)()
    assert torch.equal(clean.error_sums, sums * 0.25)
    assert torch.allclose(scaled.error_sums, clean.error_sums, rtol=1e-15)
    assert torch.allclose(scaled.norms, clean.norms, rtol=1e-12)


def paced_runtimes(every: int):
    """``(units, step cell, make)``: ``make()`` builds a runtime with gamma 0.5 and
    ``error_every=every`` whose error source reads ``rank_errors`` at the step in the cell."""
    reg = UnitRegistry.from_model(full_model_with_grads())
    u, step = reg.num_units, [0]
    cfg = GNMRConfig(warmup_steps=0, max_active=1, gamma=0.5)

    def make() -> GNMRRuntime:
        fn = lambda device: rank_errors(0, u, step[0]).to(device)  # noqa: E731
        return GNMRRuntime(reg, cfg, error_fn=fn, error_every=every)

    return u, step, make


def test_each_plan_carries_whether_its_step_measures_the_error_sums():
    """Decided once at build (gamma, error_every), handed down with every plan, a fresh and a
    reset runtime included; never True without gamma."""
    _, step, make = paced_runtimes(2)
    runtime = make()
    measured = []
    for t in range(1, 6):
        step[0] = t
        assert runtime.plan.step == t
        measured.append(runtime.plan.measure_errors)
        runtime.step()
    assert measured == [False, True, False, True, False]
    runtime.reset()
    assert runtime.plan.step == 1 and not runtime.plan.measure_errors
    plain = GNMRRuntime(runtime.registry, GNMRConfig(warmup_steps=0), error_every=1)
    assert not plain.plan.measure_errors and not plain.uses_errors


def test_error_every_measures_on_its_steps_and_carries_the_score_between():
    u, step, make = paced_runtimes(3)
    runtime = make()
    seen = {}
    for t in range(1, 8):
        step[0] = t
        assert runtime.errors_due() == (t % 3 == 0)
        d = runtime.step()
        n = runtime.last_norms
        assert (n.error_sums is None) == (t % 3 != 0)  # the U + 1 vector between measurements
        seen[t] = d.error
    zero = torch.zeros(u, dtype=torch.float64)
    assert torch.equal(seen[1], zero) and torch.equal(seen[2], zero)  # nothing measured yet
    for measured, carried in ((3, (4, 5)), (6, (7,))):
        assert torch.allclose(seen[measured], rank_errors(0, u, measured) / n.global_norm)
        for t in carried:
            assert torch.equal(seen[t], seen[measured])
    with pytest.raises(ValueError, match=r"gnmr\.error_every must be an integer >= 1"):
        GNMRRuntime(runtime.registry, runtime.controller.config, error_every=0)


def test_a_nan_unit_keeps_the_budget_for_itself_with_the_error_term():
    """Without G's NaN guard every e would be NaN (+inf risk) and the budget would go to the
    lowest ids; with it the NaN unit is selected, as without the error term."""
    cfg = GNMRConfig(warmup_steps=0, max_active=2, gamma=10.0)
    model = full_model_with_grads()
    reg = UnitRegistry.from_model(model)
    runtime = GNMRRuntime(reg, cfg, error_fn=lambda device: torch.zeros(reg.num_units))
    u = reg.num_units
    norms = torch.ones(u, dtype=torch.float64)
    for _ in range(3):
        runtime.observe(UnitNorms(norms, 1.0, 3.0, error_sums=torch.full((u,), 0.1)))
    norms[u - 1] = math.nan
    d = runtime.observe(UnitNorms(norms, 1.0, math.nan, error_sums=torch.full((u,), 0.1)))
    assert d.active == (u - 1,)


def test_the_carried_error_score_survives_a_checkpoint():
    u, step, make = paced_runtimes(4)
    straight, resumed = make(), make()
    for t in range(1, 6):
        step[0] = t
        straight.step()
        if t == 4:
            saved = straight.state_dict()
    assert saved["last_errors"].shape == (u,)
    resumed.load_state_dict(saved)
    step[0] = 5
    d = resumed.step()
    assert torch.equal(d.error, straight.last_decision.error)  # carried, not 0
    assert torch.equal(d.risk, straight.last_decision.risk)
    _, _, every_step = paced_runtimes(1)
    assert "last_errors" not in every_step().state_dict()


def _spiked_runtime(cfg: GNMRConfig) -> GNMRRuntime:
    """A runtime whose last decision put units 0-2 (at most ``max_active``) on the recovery
    path with fresh locks."""
    reg = UnitRegistry.from_model(full_model_with_grads())
    runtime = GNMRRuntime(reg, cfg)
    norms = torch.ones(reg.num_units, dtype=torch.float64)
    for _ in range(4):
        runtime.observe(UnitNorms(norms, 1.0, 3.0))
    norms[:3] = 50.0
    d = runtime.observe(UnitNorms(norms, 1.0, 3.0))
    assert d.active == tuple(range(min(3, cfg.max_active)))
    return runtime


def test_a_resume_with_a_tighter_policy_saves_states_that_load_again():
    """Resumed with lock_steps 10 -> 3 and max_active 3 -> 1: the current policy wins, so the
    restored locks and plan are conformed to it at once, and a state saved right away (or a
    step later) satisfies its own config's invariants and loads."""
    saved = _spiked_runtime(GNMRConfig(warmup_steps=0, max_active=3, lock_steps=10)).state_dict()
    tight = GNMRConfig(warmup_steps=0, max_active=1, lock_steps=3)
    resumed = _spiked_runtime(tight)
    resumed.load_state_dict(saved)
    assert resumed.plan.active == {0} and int(resumed.controller.locks.max()) == 3
    assert int((resumed.controller.locks > 0).sum()) == 1
    again = _spiked_runtime(tight)
    again.load_state_dict(resumed.state_dict())  # saved before any step
    norms = torch.ones(again.registry.num_units, dtype=torch.float64)
    again.observe(UnitNorms(norms, 1.0, 3.0))
    _spiked_runtime(tight).load_state_dict(again.state_dict())


def test_a_refused_plan_restores_nothing():
    from gnmr_dist.state import seal, unseal

    runtime = _spiked_runtime(GNMRConfig(warmup_steps=0, max_active=3, lock_steps=10))
    body, _ = unseal(runtime.state_dict(), "state")
    body["plan_active"] = [0]  # units 1 and 2 hold locks outside the plan
    fresh = GNMRRuntime(runtime.registry, runtime.controller.config)
    before = fresh.controller.state_dict()
    with pytest.raises(ValueError, match=r"lock holders \[0, 1, 2\] must all be active"):
        fresh.load_state_dict(seal(body))
    after = fresh.controller.state_dict()
    assert after["step"] == 0 and torch.equal(after["lock"], before["lock"])
