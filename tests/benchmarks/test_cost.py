"""Cost at matched loss (issue 35): the model's figures against hand-computed ones on constructed
branch records, its undefined and unpriced cases, and the regimes' formats priced as stated."""

from __future__ import annotations

import math

import pytest

from benchmarks.harness.branch_stats import Design
from benchmarks.harness.cost import (
    HARDWARE,
    Formats,
    Price,
    assumptions,
    branch_cost,
    cost_table,
    extra_steps,
    flops_share,
    price,
    seed_costs,
    speedup,
    step_time,
    summarize_costs,
)
from benchmarks.harness.stats import t95

NVFP4 = Formats("fp8_emulated", {"format": "e2m1"}, {"format": "bf16"})
FP8 = Formats("fp8_emulated", {"format": "e4m3"}, {"format": "bf16"})
ONE = Design(seeds=(1,), points=(100,), horizon=50)


def rec(arm, seed, point, h25, h50, flops=None, unit_steps=None):
    """A branch record as :func:`benchmarks.harness.branch.run_branch` writes it (the fields the
    cost model reads); ``unit_steps``: (recovered, total) for a record without flops_recovered."""
    r = {"arm": arm, "seed": seed, "point": point, "heldout": {"25": h25, "50": h50}}
    recovered, total = unit_steps or (round(1400 * (flops or 0.0)), 1400)
    r |= {"recovered_unit_steps": recovered, "unit_steps": total}
    if flops is not None:
        r["flops_recovered"] = flops
    return r


def records(*rows):
    return {(r["arm"], r["seed"], r["point"]): r for r in rows}


def test_one_arm_by_hand():
    """r = (2.1 - 2.0) / 25 = 0.004 / step, g = 2.02 - 2.0 = +0.02: D = 5 steps; s = 0.1:
    B200 t = 0.9 / 4 + 0.1 = 0.325, S = 50 / (55 * 0.325) = 2.797; GB300 t = 0.9 / 6 + 0.1 =
    0.25, S = 50 / (55 * 0.25) = 3.636; Hopper: no FP4 GEMMs."""
    bf16 = rec("BF16", 1, 100, 2.1, 2.0, flops=1.0)
    arm = rec("GNMR+e 4", 1, 100, 2.13, 2.02, flops=0.1)
    c = branch_cost(arm, bf16, 50, price(NVFP4, "B200"))
    assert c.rate == pytest.approx(0.004)
    assert c.gap == pytest.approx(0.02)
    assert c.extra_steps == pytest.approx(5.0)
    assert c.time == pytest.approx(0.325)
    assert c.speedup == pytest.approx(50 / (55 * 0.325))
    assert c.speedup == pytest.approx(2.7972, abs=1e-4)
    gb = branch_cost(arm, bf16, 50, price(NVFP4, "GB300"))
    assert gb.time == pytest.approx(0.25)
    assert gb.speedup == pytest.approx(50 / (55 * 0.25))
    hopper = branch_cost(arm, bf16, 50, price(NVFP4, "Hopper"))
    assert hopper.speedup is None and hopper.note == "n/a (no FP4 GEMMs)"
    assert hopper.extra_steps == pytest.approx(5.0)  # the conversion itself needs no price
    # the same through the per-seed and summary functions
    rs = records(bf16, arm)
    (seed,) = seed_costs(rs, ONE, NVFP4, "B200")["GNMR+e 4"]
    assert (seed.extra_steps, seed.time) == (pytest.approx(5.0), pytest.approx(0.325))
    summary = summarize_costs(rs, ONE, NVFP4)
    cells = summary["GNMR+e 4"]["hardware"]
    assert cells["B200"]["speedup"][0] == pytest.approx(50 / (55 * 0.325))
    assert math.isnan(cells["B200"]["speedup"][1])  # one seed: no interval
    assert cells["Hopper"]["speedup"] is None
    assert cells["Hopper"]["note"] == "n/a (no FP4 GEMMs)"
    table = cost_table(summary)
    row = "| GNMR+e 4 | 10.0% | - | 5.0 (one seed) | not by 50: 1 | 2.80 (one seed) | "
    row += "3.64 (one seed) |"
    assert row in table
    assert table.rstrip().endswith("n/a (no FP4 GEMMs) |")


def test_the_formulas_alone():
    assert extra_steps(0.02, 0.004) == pytest.approx(5.0)
    assert extra_steps(-0.01, 0.002) == pytest.approx(-5.0)  # ahead of BF16: fewer steps
    assert step_time(0.1, Price(0.25, 1.0)) == pytest.approx(0.325)
    assert speedup(50, 5.0, 0.325) == pytest.approx(50 / 17.875)
    assert speedup(50, -50.0, 0.5) is None  # ahead by the whole horizon: outside the model
    with pytest.raises(ValueError, match="not priced"):
        step_time(0.5, Price(note="n/a (no FP4 GEMMs)"))


@pytest.mark.parametrize("hw", ["B200", "GB300"])
def test_bf16_is_exactly_one(hw):
    bf16 = rec("BF16", 1, 100, 2.1, 2.0, flops=1.0)
    c = branch_cost(bf16, bf16, 50, price(NVFP4, hw))
    assert (c.extra_steps, c.time, c.speedup) == (0.0, 1.0, 1.0)
    fp8 = branch_cost(bf16, bf16, 50, price(FP8, "Hopper"))
    assert fp8.speedup == 1.0


def test_bf16_is_one_even_where_the_rate_is_not_measurable():
    """No gap needs no extra steps: BF16 against itself is 1 whatever the rate."""
    bf16 = rec("BF16", 1, 100, 2.0, 2.0, flops=1.0)
    assert branch_cost(bf16, bf16, 50, price(NVFP4, "B200")).speedup == 1.0


@pytest.mark.parametrize(
    ("formats", "hw", "rate"),
    [(NVFP4, "B200", 4.0), (NVFP4, "GB300", 6.0), (FP8, "B200", 2.0), (FP8, "Hopper", 2.0)],
)
def test_low_cost_without_a_gap_runs_at_its_formats_rate(formats, hw, rate):
    bf16 = rec("BF16", 1, 100, 2.1, 2.0, flops=1.0)
    low = rec("low-cost", 1, 100, 2.2, 2.0, flops=0.0)
    assert branch_cost(low, bf16, 50, price(formats, hw)).speedup == pytest.approx(rate)


def test_no_measurable_progress_is_undefined():
    """r = 0 and r < 0 with a gap: no division, the note says why, the table says undefined."""
    for h25 in (2.0, 1.99):
        bf16 = rec("BF16", 1, 100, h25, 2.0, flops=1.0)
        arm = rec("low-cost", 1, 100, 2.03, 2.01, flops=0.0)
        c = branch_cost(arm, bf16, 50, price(NVFP4, "B200"))
        assert c.rate <= 0
        assert (c.extra_steps, c.time, c.speedup) == (None, None, None)
        assert c.note == "undefined: no measurable progress (r <= 0)"
        summary = summarize_costs(records(bf16, arm), ONE, NVFP4)
        row = summary["low-cost"]
        assert row["extra_steps"] is None
        assert row["extra_steps_note"] == (
            "seed 1: undefined: no measurable progress (r <= 0) at point 100"
        )
        assert row["hardware"]["B200"]["speedup"] is None
        assert row["hardware"]["B200"]["note"].startswith("seed 1: undefined")
        assert row["hardware"]["Hopper"]["note"] == "n/a (no FP4 GEMMs)"
        line = cost_table(summary).splitlines()[-1]
        # steps and one column for B200 and GB300, whose cells are the same
        assert line.count("undefined: no measurable progress") == 2


def test_a_diverged_branch_is_undefined():
    bf16 = rec("BF16", 1, 100, 2.1, 2.0, flops=1.0)
    arm = rec("low-cost", 1, 100, 2.1, math.inf, flops=0.0)
    c = branch_cost(arm, bf16, 50, price(NVFP4, "B200"))
    assert c.speedup is None and c.note == "undefined: a loss is not finite"


def test_old_records_use_the_unit_step_share():
    """No ``flops_recovered``: recovered / total unit-steps (140 / 1400 = 0.1), the same figure
    as the hand case; a record with it uses it even where the unit-step share differs."""
    bf16 = rec("BF16", 1, 100, 2.1, 2.0, unit_steps=(1400, 1400))
    old = rec("GNMR+e 4", 1, 100, 2.13, 2.02, unit_steps=(140, 1400))
    assert flops_share(old) == (pytest.approx(0.1), True)
    assert branch_cost(old, bf16, 50, price(NVFP4, "B200")).speedup == pytest.approx(
        50 / (55 * 0.325)
    )
    new = old | {"flops_recovered": 0.3}  # per-GEMM recovery: the FLOP share differs
    assert flops_share(new) == (0.3, False)
    assert branch_cost(new, bf16, 50, price(NVFP4, "B200")).time == pytest.approx(0.7 / 4 + 0.3)
    summary = summarize_costs(records(bf16, old), ONE, NVFP4)
    assert summary["GNMR+e 4"]["flops_from_unit_steps"] == 1
    assert "10.0% (unit-steps)" in cost_table(summary)


def test_two_seeds_two_points_by_hand():
    """B200, NVFP4 / BF16, per branch (r, g, D, s, t, and the branch's own ratio S):
    seed 1, point 100: r = 0.1/25 = 0.004, g = +0.02, D = 5,  s = 0.1, t = 0.325, S = 50/(55*0.325)
    seed 1, point 175: r = 0.05/25 = 0.002, g = -0.01, D = -5, s = 0.3, t = 0.475, S = 50/(45*0.475)
    seed 2, point 100: r = 0.004, g = 0, D = 0, s = 0.2, t = 0.4, S = 50/(50*0.4) = 2.5
    seed 2, point 175: r = 0.004, g = +0.04, D = 10, s = 0, t = 0.25, S = 50/(60*0.25) = 3.333
    per seed (mean over points): D 0 and 5, t 0.4 and 0.325; the speed-up at the means over
    seeds, 50 / ((50 + 2.5) * 0.3625) = 2.6273, not the mean of the seeds' mean ratios (2.5682
    and 2.9167: 2.7424); its half-width by the delta method, paired: the seeds' linearized
    values S (1 - (D_s - 2.5) / 52.5 - (t_s - 0.3625) / 0.3625), 12.706 * |l1 - l2| / 2."""
    rs = records(
        rec("BF16", 1, 100, 2.2, 2.1, flops=1.0),
        rec("BF16", 1, 175, 2.05, 2.0, flops=1.0),
        rec("BF16", 2, 100, 2.3, 2.2, flops=1.0),
        rec("BF16", 2, 175, 2.1, 2.0, flops=1.0),
        rec("GNMR+e 4", 1, 100, 2.2, 2.12, flops=0.1),
        rec("GNMR+e 4", 1, 175, 2.0, 1.99, flops=0.3),
        rec("GNMR+e 4", 2, 100, 2.3, 2.2, flops=0.2),
        rec("GNMR+e 4", 2, 175, 2.1, 2.04, flops=0.0),
    )
    d = Design(seeds=(1, 2), points=(100, 175), horizon=50)
    s1 = (50 / (55 * 0.325) + 50 / (45 * 0.475)) / 2
    s2 = (2.5 + 50 / (60 * 0.25)) / 2
    assert (s1, s2) == (pytest.approx(2.568192, abs=1e-6), pytest.approx(2.916667, abs=1e-6))

    seeds = seed_costs(rs, d, NVFP4, "B200")["GNMR+e 4"]
    assert [c.extra_steps for c in seeds] == [pytest.approx(0.0, abs=1e-9), pytest.approx(5.0)]
    assert [c.time for c in seeds] == [pytest.approx(0.4), pytest.approx(0.325)]
    assert [c.flops_recovered for c in seeds] == [pytest.approx(0.2), pytest.approx(0.1)]

    row = summarize_costs(rs, d, NVFP4)["GNMR+e 4"]
    b200 = row["hardware"]["B200"]
    assert t95(1) == 12.706
    s = 50 / (52.5 * 0.3625)
    lin = [s * (1 + 2.5 / 52.5 - 0.0375 / 0.3625), s * (1 - 2.5 / 52.5 + 0.0375 / 0.3625)]
    assert b200["speedup"][0] == pytest.approx(2.627258, abs=1e-6)
    assert b200["speedup"][0] < (s1 + s2) / 2 == pytest.approx(2.742430, abs=1e-6)
    assert b200["speedup"][1] == pytest.approx(12.706 * abs(lin[0] - lin[1]) / 2)
    assert b200["speedup"][1] == pytest.approx(1.86369, abs=1e-5)
    assert row["extra_steps"][0] == pytest.approx(2.5)
    assert row["extra_steps"][1] == pytest.approx(12.706 * 5 / 2)  # 31.765
    assert row["flops_recovered"] == pytest.approx(0.15)
    assert row["flops_from_unit_steps"] == 0
    assert row["hardware"]["Hopper"]["note"] == "n/a (no FP4 GEMMs)"
    # the BF16 row is exactly 1 with no spread
    bf16 = summarize_costs(rs, d, NVFP4)["BF16"]["hardware"]
    assert bf16["B200"]["speedup"] == (1.0, 0.0) and bf16["GB300"]["speedup"] == (1.0, 0.0)
    table = cost_table(summarize_costs(rs, d, NVFP4), details=False)
    assert table.splitlines()[0] == (
        "| arm | speed-up at matched loss, B200 | speed-up at matched loss, GB300 "
        "| speed-up at matched loss, Hopper |"
    )
    assert "| BF16 | 1.00 +- 0.00 | 1.00 +- 0.00 | n/a (no FP4 GEMMs) |" in table
    assert "| GNMR+e 4 | 2.63 +- 1.86 |" in table


def test_incomplete_arms_and_reference():
    rs = records(rec("BF16", 1, 100, 2.1, 2.0, flops=1.0), rec("low-cost", 1, 100, 2.2, 2.0, 0.0))
    d = Design(seeds=(1,), points=(100, 175), horizon=50)
    assert summarize_costs(rs, d, NVFP4) == {}  # the reference lacks a branch
    rs |= records(rec("BF16", 1, 175, 2.1, 2.0, flops=1.0))
    assert list(summarize_costs(rs, d, NVFP4)) == ["BF16"]  # low-cost lacks one


def test_prices_of_formats():
    """FP6 runs at the FP8 rate on Blackwell and not at all on Hopper; a GEMM with a wider
    operand runs at its rate (fprop FP4, dgrad and wgrad BF16: (1/4 + 2) / 3 = 0.75); int8 runs
    fprop at the INT8 rate and dgrad in BF16 ((1/2 + 1) / 2), not on GB300; act_quant, fp32 and
    other backends are not priced."""
    fp6 = Formats(
        "fp8_emulated",
        {"format": "e2m3", "grad_format": "e3m2", "granularity": "block", "block": 128},
        {"format": "e4m3", "granularity": "block", "block": 128},
    )
    assert price(fp6, "B200") == Price(0.5, 0.5)
    assert price(fp6, "GB300") == Price(0.5, 0.5)
    assert price(fp6, "Hopper").note == "n/a (no FP6 GEMMs)"
    mixed = Formats("fp8_emulated", {"format": "e2m1", "grad_format": "bf16"}, {})
    assert price(mixed, "B200") == Price(pytest.approx(0.75), 1.0)  # recovery defaults to bf16
    assert price(Formats("fp8_emulated", {}, {}), "Hopper") == Price(0.5, 1.0)  # e4m3 default
    assert price(Formats("fp8_emulated", {"format": "e5m2"}, {}), "GB300") == Price(0.5, 1.0)
    act = price(Formats("act_quant", {"bits": 2}, {"bits": 8}), "B200")
    assert act.note is not None and act.note.startswith("not priced: act_quant")
    assert "memory" in act.note
    assert price(Formats("int8", {}, {"dtype": "bf16"}), "Hopper") == Price(0.75, 1.0)
    assert price(Formats("int8", {}, {"dtype": "bf16"}), "GB300").note == (
        "not priced: GB300's INT8 rate is not in the cost table"
    )
    assert price(Formats("int8", {}, {"dtype": "fp32"}), "B200").note == (
        "not priced: int8's fp32 recovery GEMMs are not in the cost table"
    )
    assert price(Formats("te_fp8", {}, {}), "B200").note == (
        "not priced: the te_fp8 backend's formats are not in the cost table"
    )
    fp32 = price(Formats("fp8_emulated", {"format": "e4m3"}, {"format": "fp32"}), "B200")
    assert fp32.note == "not priced: fp32 GEMMs are not in the cost table"
    with pytest.raises(ValueError, match="unknown hardware"):
        price(NVFP4, "MI300")


def test_a_not_priced_regime_in_the_table():
    rs = records(rec("BF16", 1, 100, 2.1, 2.0, flops=1.0), rec("low-cost", 1, 100, 2.2, 2.01, 0.0))
    summary = summarize_costs(rs, ONE, Formats("act_quant", {"bits": 2}, {"bits": 8}))
    row = summary["low-cost"]
    assert row["extra_steps"][0] == pytest.approx(2.5)  # the loss side is still measured
    assert all(row["hardware"][hw]["note"].startswith("not priced") for hw in HARDWARE)
    # no hardware prices it: one column for all three
    assert cost_table(summary).count("not priced: act_quant") == 2
    assert "speed-up at matched loss, B200, GB300, Hopper |" in cost_table(summary)


def test_the_regimes_formats():
    """Every branch regime is priced from its own option blocks; the FP4 ones are n/a on Hopper,
    act_quant (the selection sweeps' and paper experiment 1's) is not priced, int8 is priced on
    B200 and Hopper only, fp6_fp8's recovery runs at the FP8 rate."""
    from benchmarks.sweep.regimes import BRANCH_REGIMES, FP4_REGIMES, REGIMES

    assert price(Formats.of(FP4_REGIMES["nvfp4"]), "B200") == Price(0.25, 1.0)
    assert price(Formats.of(FP4_REGIMES["mxfp4"]), "GB300") == Price(pytest.approx(1 / 6), 1.0)
    for name, regime in BRANCH_REGIMES.items():
        fp4 = regime.low_cost.get("format") == "e2m1"
        hopper = price(Formats.of(regime), "Hopper")
        assert (hopper.note == "n/a (no FP4 GEMMs)") == fp4, name
        b200 = price(Formats.of(regime), "B200").note
        if regime.backend == "act_quant":  # saved activations only: GEMM rates do not change
            assert b200 is not None and b200.startswith("not priced"), name
        elif regime.backend == "int8":  # fprop INT8 at 2x, dgrad in high precision, no wgrad
            assert price(Formats.of(regime), "B200") == Price(0.75, 1.0), name
            assert price(Formats.of(regime), "GB300").note.startswith("not priced"), name
        else:
            assert b200 is None, name
    assert price(Formats.of(REGIMES["act_quant"]), "B200").note.startswith("not priced")
    assert price(Formats.of(REGIMES["fp6_fp8"]), "B200") == Price(0.5, 0.5)
    assert price(Formats.of(REGIMES["delayed"]), "Hopper") == Price(0.5, 1.0)


def test_assumptions_are_printable():
    lines = assumptions(NVFP4)
    assert all(isinstance(x, str) and x for x in lines)
    text = "\n".join(lines)
    for phrase in ("Amdahl", "peak", "linear", "switching", "overhead_v2.json", "n/a"):
        assert phrase in text
    assert lines[-1] == "Priced: low-cost e2m1 (FP4), recovery bf16 (BF16), backend fp8_emulated."
    fp6 = Formats("fp8_emulated", {"format": "e2m3", "grad_format": "e3m2"}, {"format": "e4m3"})
    assert "e2m3 (FP6) with e3m2 gradients (FP6)" in assumptions(fp6)[-1]
    assert "not priced" in assumptions(Formats("act_quant", {}, {}))[-1]
