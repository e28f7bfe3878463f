"""The experiment harness: the pieces the seed-experiment tables rest on, against references.

Tiny models (2 layers x 32) and a few steps each, so the whole file runs in seconds on CPU.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks.harness.arms import Arm, ArmResult, Fault, Setup, with_budget
from benchmarks.harness.branch import Instrument, run_trunk
from benchmarks.harness.experiment import run_experiment
from benchmarks.harness.model import Batches, build_model, install_faults, lm_loss, save_state
from benchmarks.harness.training import ZClip, adam_inverse_rms, layer_units, run_arm
from benchmarks.harness.verdicts import table, targets
from gnmr_dist.backends import get_backend
from gnmr_dist.distributed import UnitRegistry
from gnmr_dist.telemetry.selection import gap_share, precision_at_k, spearman, top_k

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/benchmarks/conftest.py

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def tiny(**kw) -> Setup:
    """2 layers x 32, 16-token samples, 3 steps; GNMR thresholds low enough to act."""
    base = {
        "layers": 2,
        "hidden": 32,
        "heads": 2,
        "ffn": 64,
        "seq_len": 16,
        "batch": 2,
        "steps": 3,
        "max_bytes": 30_000,
        "eval_every": 3,
        "eval_batches": 1,
        "gnmr": {"warmup_steps": 0, "alpha": 1.0, "beta": 1.0},
    }
    return Setup(**{**base, **kw})


def tiny_trunk(root: Path, q: dict, inst: Instrument) -> tuple[Setup, Path]:
    """The branch tests' trunk: ``tiny(steps=8, lr=1e-3)`` trained on ``q``'s recovery path for
    seed 3, its checkpoints at ``inst.points`` saved under ``root``; ``(setup, root)``."""
    setup = tiny(steps=8, lr=1e-3)
    run_trunk(setup, Arm("trunk", "recovery", **q), inst, 3, root)
    return setup, root


@pytest.fixture(scope="module")
def data():
    s = tiny()
    return Batches(s.data, s), Batches(s.heldout, s)


# ---------------------------------------------------------------------------- ZClip


def zclip_reference(norms, z, momentum, warmup):
    """ZClip, clip-to-``mean + z * std`` rule, written out from the paper's equations."""
    out, mean, var = [], None, None
    for t, g in enumerate(norms):
        if t < warmup:
            out.append(None)
            if t == warmup - 1:
                mean = sum(norms[:warmup]) / warmup
                var = sum((x - mean) ** 2 for x in norms[:warmup]) / warmup
            continue
        std = math.sqrt(var)
        clip = mean + z * std if (g - mean) / std > z else None
        eff = g if clip is None else clip
        mean = momentum * mean + (1 - momentum) * eff
        var = momentum * var + (1 - momentum) * (eff - mean) ** 2
        out.append(clip)
    return out, mean, var


def test_zclip_clips_a_spike_to_mean_plus_z_std_and_tracks_the_clipped_norm():
    norms = [1.0, 2.0, 3.0, 10.0, 2.0, 2.5, 9.0, 2.0]
    guard = ZClip(2.5, momentum=0.9, warmup=3)
    got = [guard.limit(n) for n in norms]
    # warm-up: mean 2, population variance 2/3; 10 is a spike: clipped to 2 + 2.5 sqrt(2/3)
    assert got[:3] == [None, None, None]
    assert got[3] == pytest.approx(2 + 2.5 * math.sqrt(2 / 3), rel=1e-12)
    assert got[4] is None and got[5] is None
    ref, mean, var = zclip_reference(norms, 2.5, 0.9, 3)
    assert [g is None for g in got] == [r is None for r in ref]
    assert [g for g in got if g is not None] == pytest.approx([r for r in ref if r is not None])
    assert got[6] is not None and got[6] < 9.0  # the second spike is clipped too
    # the EMA absorbed the clipped values, not the raw spikes
    assert (guard.mean, guard.var) == pytest.approx((mean, var), rel=1e-12)
    assert guard.mean < 3.0


def test_zclip_never_clips_a_flat_sequence():
    guard = ZClip(2.5, warmup=5)
    assert all(guard.limit(1.0 + 1e-3 * (i % 3)) is None for i in range(60))


# ---------------------------------------------------------------------------- units


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_layer_units_are_exactly_the_seven_projections_of_the_chosen_layers(lora_rank):
    setup = tiny(layers=12, lora_rank=lora_rank)
    registry = UnitRegistry.from_model(build_model(setup), granularity="operator")
    assert registry.num_units == 7 * 12
    chosen = layer_units(registry, (0, 11))
    expected = {f"model.layers.{i}.{p}" for i in (0, 11) for p in PROJECTIONS}
    assert {registry.names[i] for i in chosen} == expected
    # layer 1 is not layers 10 and 11
    one = {registry.names[i] for i in layer_units(registry, (1,))}
    assert one == {f"model.layers.1.{p}" for p in PROJECTIONS}


def test_with_budget_rounds_a_fraction_of_the_units_and_keeps_one():
    arm = Arm("g", "gnmr", backend="act_quant")
    assert with_budget(arm, 0.1, 28).max_active == 3
    assert with_budget(arm, 0.25, 28).max_active == 7
    assert with_budget(arm, 0.001, 28).max_active == 1


# ---------------------------------------------------------------------------- arms


def q_arm(name, policy, max_active=0):
    low = {"bits": 2, "group_size": 8}
    return Arm(name, policy, backend="act_quant", low_cost=low, max_active=max_active)


def test_static_and_recovery_arms_run_one_path_and_gnmr_stays_within_budget(data):
    setup = tiny()
    train, heldout = data
    units = 7 * setup.layers
    static = run_arm(setup, q_arm("s", "static"), train, heldout)
    recovery = run_arm(setup, q_arm("r", "recovery"), train, heldout)
    full = run_arm(setup, Arm("f", "full"), train, heldout)
    gnmr = run_arm(setup, q_arm("g", "gnmr", max_active=3), train, heldout)
    assert static.recovery_rate == 0.0 and full.recovery_rate == 0.0
    assert recovery.recovery_rate == 1.0
    assert recovery.unit_recoveries == [setup.steps] * units
    assert all(a <= 3 for a in gnmr.active_per_step)
    assert 0 < gnmr.recovery_rate <= 3 / units
    assert sum(gnmr.unit_recoveries) == round(gnmr.recovery_rate * units * setup.steps)
    # step 1 always runs the low-cost path (the first plan is empty)
    assert gnmr.active_per_step[0] == 0
    for r in (static, recovery, full, gnmr):
        assert len(r.losses) == setup.steps and r.eval_steps == [3]
        assert r.heldout_ppl == pytest.approx(math.exp(r.heldout_loss))
        assert r.units == units and len(r.unit_names) == units
        # exceedance: eligible unit-steps over threshold, from the same counts
        assert r.exceedance_rate == pytest.approx(sum(r.unit_exceedances) / units / setup.steps)


def test_first_last_recovers_the_first_and_last_layer_only(data):
    setup = tiny(layers=3)
    r = run_arm(setup, q_arm("fl", "first_last"), *data)
    on = {n for n, k in zip(r.unit_names, r.unit_recoveries, strict=True) if k}
    assert on == {f"model.layers.{i}.{p}" for i in (0, 2) for p in PROJECTIONS}
    assert r.recovery_rate == pytest.approx(14 / 21)


def test_interleaved_arms_match_arms_run_one_after_another(tmp_path, monkeypatch, data):
    import benchmarks.harness.experiment as harness

    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    setup = tiny(steps=4, eval_every=2)
    arms = [q_arm("g", "gnmr", max_active=2), Arm("f", "full", save_to=str(tmp_path / "f.pt"))]
    one = run_experiment("seq", setup, arms)
    both = run_experiment("inter", setup, arms, interleave=True)
    for a, b in zip(one["results"], both["results"], strict=True):
        for key in ("losses", "eval_losses", "active_per_step", "unit_recoveries"):
            assert a[key] == b[key], key
    assert (tmp_path / "inter.json").is_file() and (tmp_path / "inter.png").is_file()
    # the saved FP32 weights reload through Setup.init_from
    reloaded = build_model(tiny(init_from=str(tmp_path / "f.pt")))
    model = build_model(setup)
    save_state(reloaded, tmp_path / "again.pt")
    saved = torch.load(tmp_path / "f.pt", weights_only=True)
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert saved.keys() == again.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], again[k]) for k in saved)
    assert not all(torch.equal(saved[k], model.state_dict()[k]) for k in saved)


def test_table_reports_deltas_to_the_reference_and_times_to_the_low_cost_arm():
    def res(name, loss, ms):
        return ArmResult(name, "x", [], [], [], loss, math.exp(loss), 0.001, 0.1, ms, 28, 3)

    rows = table([res("hi", 2.0, 10.0), res("lo", 2.1, 8.0)], "hi", "lo").splitlines()
    assert rows[2].split(" | ")[2] == "+0.00%" and rows[3].split(" | ")[2] == "+5.00%"
    assert rows[2].split(" | ")[-1] == "1.250 |" and rows[3].split(" | ")[-1] == "1.000 |"
    assert rows[3].split(" | ")[4:6] == ["0.100%", "10.00%"]


def test_targets_say_met_or_missed_from_the_numbers():
    def res(name, loss, ms, exceed=0.001, rec=0.0, max_active=0):
        return ArmResult(
            name, "x", [], [], [], loss, math.exp(loss), exceed, rec, ms, 28, max_active
        )

    rs = [
        res("hi", 2.0, 10.0),
        res("lo", 2.05, 8.0, exceed=0.003),
        res("g", 2.01, 8.4, rec=0.05, max_active=3),
    ]
    lines = targets(rs, "hi", "lo", "g").splitlines()
    assert lines[0] == "- g within 1% of hi: +0.50% -> met"
    assert lines[1] == "- lo worse than hi by more than 1%: +2.50% -> met"
    assert lines[2] == "- g recovery rate 5.00% vs budget 10.71% (3 of 28 units)"
    assert lines[3].startswith("- exceedance rate below the paper's 0.2%: 2 of 3 arms")
    assert lines[4] == "- step time g / lo: 1.050 (target <= 1.03) -> MISSED"


# ---------------------------------------------------------------------------- probe


def test_probing_changes_nothing_in_training_and_grades_every_set(data):
    setup = tiny(layers=3, steps=4)
    plain = run_arm(setup, q_arm("g", "gnmr", max_active=2), *data)
    probed = run_arm(setup, replace(q_arm("g", "gnmr", max_active=2), probe_every=2), *data)
    for key in ("losses", "eval_losses", "active_per_step", "unit_recoveries", "unit_exceedances"):
        assert getattr(probed, key) == getattr(plain, key), key
    assert plain.probes == [] and plain.probe_summary == {} and plain.probe_ms == 0.0
    assert [p["step"] for p in probed.probes] == [2, 4] and probed.probe_ms > 0
    units = 21
    first_last = {i for i, n in enumerate(probed.unit_names) if ".layers.1." not in n}
    for p in probed.probes:
        grad, update, risk = (
            torch.tensor(p[k], dtype=torch.float64) for k in ("grad_gap", "update_gap", "risk")
        )
        assert grad.shape == (units,) and bool((grad > 0).all()) and bool((update > 0).all())
        sets, figures = p["sets"], p["figures"]
        assert set(sets["first_last"]) == first_last and len(sets["random"]) == 3
        assert sets["risk_topk"] == sorted(top_k(risk, 3))
        assert figures["risk_topk"]["precision_grad"] == precision_at_k(risk, grad, 3)
        assert figures["risk_topk"]["precision_update"] == precision_at_k(risk, update, 3)
        assert figures["first_last"]["share_grad"] == gap_share(first_last, grad)
        # the oracle: precision 1 and the largest share of any 3-set
        assert figures["oracle_grad"]["precision_grad"] == 1.0
        assert figures["oracle_update"]["precision_update"] == 1.0
        best = figures["oracle_grad"]["share_grad"]
        assert best >= max(figures[n]["share_grad"] for n in ("risk_topk", "random"))
        assert p["spearman"]["risk_grad"] == spearman(risk, grad)
    mean = sum(p["figures"]["random"]["share_grad"] for p in probed.probes) / 2
    assert probed.probe_summary["random"]["share_grad"] == pytest.approx(mean)


def test_a_probe_step_measures_the_steps_own_batch_and_weights(data):
    """Step 1 of a static arm against two twins of the initial model on batch 0."""
    setup = tiny(steps=1)
    train, heldout = data
    arm = replace(q_arm("s", "static"), probe_every=1)
    (probe,) = run_arm(setup, arm, train, heldout).probes
    grads = {}
    for path, plan in (("low", ()), ("high", None)):
        model = build_model(setup)
        registry = UnitRegistry.from_model(model, granularity="operator")
        backend = get_backend("act_quant", low_cost=arm.low_cost)
        backend.wrap(registry.local_modules)
        backend.apply(range(registry.num_units) if plan is None else plan, step=1)
        lm_loss(model, train(0)).backward()
        grads[path] = [p.grad.double() for p in registry.params]
        slots = registry.param_slots.tolist()
    grad_gap = torch.zeros(registry.num_units, dtype=torch.float64)
    update_gap = torch.zeros(registry.num_units, dtype=torch.float64)
    for lo, hi, s in zip(grads["low"], grads["high"], slots, strict=True):
        if s < registry.num_units:  # AdamW's first step: v_hat = g_high^2, eps = 1e-8
            grad_gap[s] += (lo - hi).square().sum()
            update_gap[s] += ((lo - hi) / (hi.abs() + 1e-8)).square().sum()
    got = torch.tensor(probe["grad_gap"], dtype=torch.float64)
    assert torch.allclose(got, grad_gap.sqrt(), rtol=1e-6, atol=0)
    got = torch.tensor(probe["update_gap"], dtype=torch.float64)
    assert torch.allclose(got, update_gap.sqrt(), rtol=1e-6, atol=0)
    assert probe["sets"]["active"] == []  # the static arm recovers nothing


def test_a_probe_needs_a_backend_and_a_sane_k():
    with pytest.raises(ValueError, match="the probe needs a backend"):
        Arm("f", "full", probe_every=2)
    with pytest.raises(ValueError, match=r"probe_k \(0\) >= 1"):
        Arm("g", "gnmr", backend="act_quant", probe_every=2, probe_k=0)


# ---------------------------------------------------------------------------- issue 13's arms


def test_random_arm_redraws_k_eligible_units_every_step_reproducibly(data):
    setup = tiny(steps=4)
    arm = q_arm("r", "random", max_active=2)
    a, b = run_arm(setup, arm, *data), run_arm(setup, arm, *data)
    assert a.active_per_step == [2, 2, 2, 2]
    assert sum(a.unit_recoveries) == 2 * 4  # the backend ran exactly the drawn units
    assert a.unit_recoveries == b.unit_recoveries and a.losses == b.losses
    assert sum(1 for c in a.unit_recoveries if c) > 2  # re-drawn: more than one set over the run
    with pytest.raises(ValueError, match="policy random needs max_active >= 1"):
        q_arm("r", "random")


def test_oracle_arm_recovers_the_k_largest_gaps_measured_on_the_step_itself(data):
    setup = tiny(steps=3)
    arm = replace(q_arm("o", "oracle", max_active=3), probe_every=1)
    result = run_arm(setup, arm, *data)
    assert result.active_per_step == [3, 3, 3] and len(result.probes) == 3
    for p in result.probes:
        assert p["sets"]["active"] == sorted(top_k(torch.tensor(p["grad_gap"]), 3))
        assert p["figures"]["active"]["precision_grad"] == 1.0
    by_update = run_arm(setup, replace(arm, oracle_by="update"), *data)
    for p in by_update.probes:
        assert p["sets"]["active"] == sorted(top_k(torch.tensor(p["update_gap"]), 3))
    with pytest.raises(ValueError, match="oracle_by must be"):
        replace(arm, oracle_by="loss")


def test_a_fault_scales_one_input_channel_inside_its_window_only():
    setup = tiny(steps=1)
    model = build_model(setup)
    step = [0]
    fault = Fault("model.layers.1.mlp.up_proj", 100.0, start=2, stop=4, channel=5)
    install_faults(model, [fault], lambda: step[0])
    seen = []
    up = model.model.layers[1].mlp.up_proj
    up.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    tokens = torch.randint(0, 258, (1, 8))
    for step[0] in (1, 2, 3, 4):
        model(tokens)
    model.eval()
    step[0] = 2
    model(tokens)
    before, inside, inside2, after, evaluated = seen
    assert torch.equal(after, before) and torch.equal(evaluated, before)
    for x in (inside, inside2):
        assert torch.allclose(x[..., 5], 100 * before[..., 5])
        assert torch.equal(
            torch.cat([x[..., :5], x[..., 6:]], -1),
            torch.cat([before[..., :5], before[..., 6:]], -1),
        )
    with pytest.raises(ValueError, match=r"fault module 'model\.layers\.9\.mlp\.up_proj' is not"):
        install_faults(model, [replace(fault, module="model.layers.9.mlp.up_proj")], lambda: 0)


def test_adam_inverse_rms_against_the_optimizer_state_written_out():
    setup = tiny(steps=1)
    model = build_model(setup)
    registry = UnitRegistry.from_model(model, granularity="operator")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    assert torch.equal(adam_inverse_rms(registry, opt), torch.zeros(registry.num_units))
    for _ in range(2):
        opt.zero_grad()
        lm_loss(model, torch.randint(0, 258, (2, 8))).backward()
        opt.step()
    want = torch.zeros(registry.num_units, dtype=torch.float64)
    count = torch.zeros(registry.num_units, dtype=torch.float64)
    for p, s in zip(registry.params, registry.param_slots.tolist(), strict=True):
        if s < registry.num_units:
            v_hat = opt.state[p]["exp_avg_sq"].double() / (1 - 0.95**2)
            want[s] += (1 / (v_hat.sqrt() + 1e-6) ** 2).sum()
            count[s] += p.numel()
    assert torch.allclose(adam_inverse_rms(registry, opt), (want / count).sqrt(), rtol=1e-12)


def test_probe_records_grade_the_error_scores_of_the_steps_own_forward(data):
    setup = tiny(steps=2)
    result = run_arm(setup, replace(q_arm("s", "static"), probe_every=1), *data)
    for p in result.probes:
        bound = torch.tensor(p["scores"]["error_bound"], dtype=torch.float64)
        assert bool((bound > 0).all())
        ratio = torch.tensor(p["scores"]["error_global"], dtype=torch.float64) / bound
        assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-12)  # B / G: one G
        for name in ("error_bound", "error_global", "error_relative", "error_adam"):
            assert p["sets"][f"{name}_topk"] == sorted(top_k(torch.tensor(p["scores"][name]), 3))
            assert f"{name}_update" in p["spearman"]


def test_probe_steps_add_probes_on_the_named_steps(data):
    setup = tiny(steps=4)
    result = run_arm(setup, replace(q_arm("s", "static"), probe_every=4, probe_steps=(1, 2)), *data)
    assert [p["step"] for p in result.probes] == [1, 2, 4]


def test_results_are_written_to_benchmarks_results():
    """Every study writes beside the committed results (the harness's own folder is not one)."""
    from benchmarks.harness.common import RESULTS

    root = Path(__file__).resolve().parents[2]
    assert root / "benchmarks" / "results" == RESULTS
    assert (RESULTS / "overhead.json").is_file() and (RESULTS / "fp4" / "nvfp4.jsonl").is_file()
