"""Issue 44's faults as real models have them: the onsets' schedules, the gradient-visible
outlier's gradient, the grid's cells and the break-even arithmetic."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from benchmarks.harness.arms import Arm
from benchmarks.harness.break_even import advantage, break_even
from benchmarks.harness.fault_shapes import WINDOW, ShapedOutlier, shaped_plan
from benchmarks.harness.model import Batches
from benchmarks.harness.training import ArmRun
from benchmarks.sweep import fault_grid, grid_cells
from tests.benchmarks.test_harness import tiny

Q = {"backend": "fp8_emulated", "low_cost": {"format": "e4m3"}, "recovery": {"format": "bf16"}}


def _factors(log2_peak: int, onset: str) -> list[float | None]:
    o = shaped_plan(log2_peak, onset).at(7, 100, 4, 344)
    return [o.factor(t) for t in range(o.start - 1, o.start + o.length + 1)]


def test_instant_and_rising_onsets_reach_the_magnitude_in_the_same_window():
    inst = _factors(13, "instant")
    assert inst[0] is None and inst[-1] is None and len(inst) == WINDOW + 2
    assert set(inst[1:-1]) == {2.0**13}
    rise = _factors(13, "rise")  # x4 per step, capped: 4, 16, ..., 4^6, then 2^13
    assert rise[1:9] == [4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 2.0**13, 2.0**13]
    assert len(rise) == WINDOW + 2 and max(f for f in rise if f) == 2.0**13
    # the present RISE (x4 to 2^20 in 10 steps, held 25) is the grid's 2^20 rise
    o = shaped_plan(20, "rise").at(7, 100, 4, 344)
    assert (o.growth, o.rise, o.hold) == (4.0, 10, 25) and o.factor(o.start + 9) == 2.0**20


def test_the_slow_onset_emerges_over_200_steps_in_powers_of_two():
    f = _factors(10, "slow")[1:-1]
    assert len(f) == 220  # 200 emerging, 20 held
    logs = [math.log2(x) for x in f if x is not None]
    assert all(x.is_integer() for x in logs)
    assert logs == sorted(logs) and logs[0] == 0 and logs[199] == 10 and logs[198] == 9
    assert [logs.index(k) for k in (1, 5, 10)] == [19, 99, 199]  # one doubling per 20 steps
    with pytest.raises(ValueError, match="power of two"):
        ShapedOutlier("m", 1, 0, peak=3.0)
    with pytest.raises(ValueError, match="onset"):
        shaped_plan(10, "sudden")


def _weight_grad(visible: bool) -> tuple[torch.Tensor, int, float]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    setup = tiny(steps=2)
    f = 2.0**10
    o = ShapedOutlier(
        "model.layers.1.mlp.down_proj",
        5,
        start=1,
        rise=1,
        hold=3,
        growth=f,
        peak=f,
        visible=visible,
    )
    s = replace(setup, outliers=(o,))
    run = ArmRun(s, Arm("BF16", "recovery", **Q), Batches(s.heldout, s), evaluates=False)
    weight = dict(run.model.named_modules())[o.module].weight
    got: list[torch.Tensor] = []
    weight.register_hook(lambda g: got.append(g.detach().clone()))
    run.step(1, Batches(s.data, s))
    return got[0], 5, f


def test_the_visible_outlier_hands_w_the_small_columns_gradient():
    """On the BF16 path (exact under powers of two) the visible outlier's ``W.grad`` is the
    function-preserving one's with column c times f: the gradient of ``V = W D^-1``."""
    plain, c, f = _weight_grad(False)
    seen, _, _ = _weight_grad(True)
    assert torch.equal(seen[:, c], plain[:, c] * f)
    others = [j for j in range(plain.shape[1]) if j != c]
    assert torch.equal(seen[:, others], plain[:, others])
    assert seen.norm() > 30 * plain.norm()  # the monitor's and the clip's norm see it


def test_break_even_arithmetic():
    # 10 steps ahead of low-cost over 50 is 0.2; 15% of the work at twice the time; c 0.02
    assert advantage(-0.01, 0.15, 0.001, 50, error=0.02) == pytest.approx(0.03)
    assert advantage(0.0, 0.1, 0.0, 50) == pytest.approx(-0.1)
    assert advantage(-0.01, 0.1, 0.0, 50) is None
    b = break_even([-0.15] * 3, [0.35] * 3)  # phi 0.35 - (1 - phi) 0.15 = 0 at 0.3
    assert b.phi == pytest.approx(0.3) and b.half == pytest.approx(0.0, abs=1e-12)
    b = break_even([-0.1, -0.2, -0.15], [0.3, 0.4, 0.35])
    assert b.phi == pytest.approx(0.15 / 0.5) and b.half > 0 and b.seeds == 3
    assert break_even([0.01, 0.02], [0.3, 0.2]).phi == 0.0  # pays without faults
    assert break_even([-0.1, -0.1], [-0.01, -0.02]).phi is None  # never pays
    with pytest.raises(ValueError, match="paired"):
        break_even([0.1], [])


def test_the_grid_cells():
    cells = grid_cells.CELLS
    assert {f"m{m}_{o}" for m in grid_cells.MAGNITUDES for o in ("instant", "rise", "slow")} <= set(
        cells
    )
    assert (
        cells["m16_slow"].instrument.horizon == 225 and cells["m16_rise"].instrument.horizon == 50
    )
    assert cells["free"].setup.outlier_plan is None
    # the report's cells and horizons (no torch) are the sweep's
    from benchmarks.harness import grid_figures

    assert set(cells) == {*grid_figures.CELLS, *grid_figures.CONTROL.values()}
    horizons = {**grid_figures.CELLS, **{c: h for h, c in grid_figures.CONTROL.items()}}
    assert all(cells[c].instrument.horizon == h for c, h in horizons.items())
    assert cells["m20_rise"].setup.outlier_plan.peak == 2.0**20  # type: ignore[union-attr]
    parent = grid_cells.PARENT
    assert cells["m10_instant"].low_cost == parent.low_cost and cells["m10_instant"].gamma == 0.02
    # a function-preserving cell shares the fault-free BF16 branches; a visible one runs its own
    plain = [a.name for a, _ in fault_grid.arms_of("m20_rise", "statics")]
    assert plain == ["low-cost", "null low-cost (1e-6)"]
    assert len(fault_grid.arms_of("m20_rise_visible", "statics")) == 4
    assert "GNMR 4" in [a.name for a, _ in fault_grid.arms_of("m20_rise_visible", "arms")]
    assert "GNMR 4" not in [a.name for a, _ in fault_grid.arms_of("m20_rise", "arms")]


def _record(arm, seed, h, losses, work=0.0, host="cpu A"):
    return {
        "arm": arm,
        "seed": seed,
        "point": 100,
        "heldout": {str(k): v for k, v in losses.items()},
        "flops_recovered": work,
        "unit_recovered": [0] * 28,
        "outliers": [],
        "train_loss": [1.0] * h,
        "provenance": {"host": {"cpu": host, "isa": "AVX512", "threads": 1, "cores": 2}},
    }


def _grid_section(root) -> str:
    """The grid's section alone, rendered from the result files under ``root``."""
    from benchmarks.report import environment
    from benchmarks.report import fault_grid as report
    from benchmarks.report.source import Source

    names = report.context(Source(root))
    return environment().get_template("fault_grid.md.j2").render(**names)


def test_the_grid_report_pairs_a_cell_with_the_fault_free_bf16_and_breaks_even(tmp_path):
    """A function-preserving cell reads BF16 from free_long at its horizon; the break-even of an
    arm follows the arithmetic from the records (rate from free_long's BF16, 25 steps)."""
    import json

    from benchmarks.harness.grid_figures import break_even_blocks, cell_row
    from benchmarks.report import fault_grid as report
    from benchmarks.report.source import Source

    seeds = (1234, 7, 42, 5, 11)
    folder = tmp_path / "fault_grid"
    folder.mkdir()
    files: dict[str, list[dict]] = {"grid_free_long": [], "grid_free": [], "grid_m20_rise": []}
    for i, s in enumerate(seeds):
        bf = {25: 3.0 + 0.01 * i, 50: 2.95 + 0.01 * i}  # rate 0.002 nats / step
        files["grid_free_long"] += [
            _record("BF16", s, 225, {**bf, 225: 2.5}),
            _record("null BF16 (1e-6)", s, 225, {**bf, 225: 2.5}),
        ]
        low_f, low_0 = bf[50] + 0.04 + 0.002 * i, bf[50] + 0.001
        files["grid_m20_rise"] += [
            _record("low-cost", s, 50, {25: 0, 50: low_f}),
            _record("null low-cost (1e-6)", s, 50, {25: 0, 50: low_f}),
            _record("GNMR+e 4", s, 50, {25: 0, 50: bf[50] + 0.001}, work=0.15),
        ]
        files["grid_free"] += [
            _record("low-cost", s, 50, {25: 0, 50: low_0}),
            _record("null low-cost (1e-6)", s, 50, {25: 0, 50: low_0}),
            _record("GNMR+e 4", s, 50, {25: 0, 50: low_0}, work=0.15),
        ]

    def write() -> Source:
        for name, rows in files.items():
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return Source(tmp_path)

    src = write()
    free = report.records(src, "free")
    row = cell_row("m20_rise", report.records(src, "m20_rise"), 50, free)
    assert row["seeds"] == list(seeds) and row["resolved"]
    assert row["gap"] == pytest.approx([0.04 + 0.002 * i for i in range(5)])
    damage = [0.039 + 0.002 * i for i in range(5)]  # low-cost against free's
    assert row["hurt"]["low-cost"] == pytest.approx(damage) and "BF16" not in row["hurt"]
    assert row["arms"]["GNMR+e 4"]["vs_low"] == pytest.approx([-d for d in damage])
    controls = {"free": cell_row("free", free, 50)}
    controls["free_long"] = {"h": 225, "n": 0, "seeds": [], "arms": {}}
    blocks = break_even_blocks([row], controls, report.records(src, "free_long"), c=0.0)
    # a_0 = -0.15 (no gain, 15% of the work at twice the time); a_f = gain / 0.002 / 50 - 0.15
    a_f = [(0.039 + 0.002 * i) / 0.002 / 50 - 0.15 for i in range(5)]
    phi = 0.15 / (0.15 + sum(a_f) / 5)
    assert blocks[0]["cells"][0]["arms"]["GNMR+e 4"]["even"].phi == pytest.approx(phi)
    assert [b["control"] for b in blocks] == ["free"]  # free_long has no arm to break even
    text = _grid_section(tmp_path)
    assert "| no fault (free): a_0 |  | 5 | -0.150 +- 0.000 (0/5 > 0) | - |" in text
    assert f"| 2^20 | x4 rise | 5 | {report.figure(a_f, 3)}: {phi:.2f} +- 0.0" in text
    assert "| 2^20 | instant | not yet run |" in text
    assert f"| 2^20 | x4 rise | 5 | {report.figure(row['gap'])} |" in text
    assert f"| {report.figure(damage)} | - |" in text  # no BF16 damage: it is free_long's
    closed = sum(damage) / sum(row["gap"])  # the arm's share of the gap at the means
    arm = f"| 2^20 | x4 rise | GNMR+e 4 | {report.figure([-d for d in damage])} | {closed:.2f} |"
    assert f"{arm} 15.0% | - |" in text
    assert "| free (50 steps) | GNMR+e 4 | 5 | +0.0000 +- 0.0000 (0/5 > 0) |" in text
    assert "| free_long (225 steps) | not yet run |" in text
    # without the arm under the fault, the cell gets the bound: the whole gap at the same spend
    files["grid_m20_rise"] = [r for r in files["grid_m20_rise"] if r["arm"] != "GNMR+e 4"]
    write()
    text = _grid_section(tmp_path)
    best = [g / 0.002 / 50 - 0.15 for g in row["gap"]]
    assert f"| 2^20 | x4 rise | 5 | <= {report.figure(best, 3)}: at least" in text
    assert "**The arms**" not in text
