"""Loss spikes (benchmarks/harness/spikes.py): the rule catches injected spikes once each,
ignores a smooth growing gap that the old rule (gap > 0.1) counted at every step, counts
non-finite losses, and the branch statistics pair per-seed counts with a Student-t interval."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from benchmarks.harness.branch_stats import (
    Design,
    spike_counts,
    spike_difference,
    table,
    troubles,
)
from benchmarks.harness.spikes import RULE, SpikeRule, gaps, spike_steps

STEPS = 50


def bf16(seed: int = 0) -> list[float]:
    """A BF16 branch's train losses: a slow decline plus each batch's own difficulty (0.15)."""
    rng = random.Random(seed)
    return [2.6 - 0.004 * t + rng.gauss(0.0, 0.15) for t in range(STEPS)]


def arm(ref: list[float], gap: list[float], noise: float, seed: int = 1) -> list[float]:
    """An arm on the same batches: BF16's losses plus ``gap`` plus its own noise."""
    rng = random.Random(seed)
    return [r + g + rng.gauss(0.0, noise) for r, g in zip(ref, gap, strict=True)]


def old_rule(arm_: list[float], ref: list[float]) -> int:
    """The count the rule replaced: every step whose loss exceeds BF16's by more than 0.1."""
    return sum(1 for a, b in zip(arm_, ref, strict=True) if not math.isfinite(a) or a - b > 0.1)


def test_injected_spikes_are_caught_each_once():
    """+0.3 nats on single steps of a noisy trajectory (gap noise 0.01, the per-tensor FP4
    stress's level), two of them 3 steps apart: the first inside the window does not hide the
    second, and the steps after each are not spikes."""
    ref = bf16()
    at = (14, 17, 30, 46)
    gap = [0.02 + 0.001 * t + (0.3 if t in at else 0.0) for t in range(STEPS)]
    assert spike_steps(arm(ref, gap, noise=0.01), ref) == list(at)
    assert old_rule(arm(ref, gap, noise=0.01), ref) == 4  # a gap below 0.1: here both agree


def test_a_smooth_growing_gap_is_no_spike_but_the_old_rule_counted_it():
    """A gap rising linearly 0 -> 0.15 over the branch plus small noise (0.002): the new rule
    counts 0 spikes, the old one counts every step past 0.1, a third of the branch."""
    ref = bf16()
    ramp = [0.15 * t / (STEPS - 1) for t in range(STEPS)]
    smooth = arm(ref, ramp, noise=0.002)
    assert spike_steps(smooth, ref) == []
    assert old_rule(smooth, ref) == 17  # steps 33-49, where the ramp is above 0.1


@pytest.mark.parametrize("top", [0.15, 1.0, 5.0])
def test_a_linear_gap_is_never_a_spike_whatever_its_slope(top):
    """The median lags a ramp by 5.5 r while k robust deviations of the ramp are 22 r."""
    ref = bf16()
    assert spike_steps(arm(ref, [top * t / STEPS for t in range(STEPS)], 0.0), ref) == []


def test_non_finite_losses_count_at_any_step_and_leave_the_window_alone():
    ref = bf16()
    losses = arm(ref, [0.02] * STEPS, noise=0.003)
    losses[3], losses[20], losses[21] = math.nan, math.inf, math.nan
    assert spike_steps(losses, ref) == [3, 20, 21]
    ref_nan = list(ref)
    ref_nan[30] = math.nan  # no gap on that step: neither a spike nor in a window
    assert spike_steps(losses, ref_nan) == [3, 20, 21]
    assert math.isnan(gaps(losses, ref_nan)[30])


def test_no_finite_spike_before_the_window_is_full():
    ref = bf16()
    gap = [0.0] * STEPS
    gap[RULE.window - 1] = 1.0  # the 10th step: 9 gaps before it
    assert spike_steps(arm(ref, gap, 0.0), ref) == []
    gap[RULE.window - 1], gap[RULE.window] = 0.0, 1.0
    assert spike_steps(arm(ref, gap, 0.0), ref) == [RULE.window]


def test_a_level_shift_counts_once_per_step_until_the_median_absorbs_it():
    """A gap that jumps by 0.3 and stays: spikes on its first ``window // 2`` steps only."""
    ref = bf16()
    shift = [0.3 if t >= 25 else 0.0 for t in range(STEPS)]
    got = spike_steps(arm(ref, shift, noise=0.003), ref)
    assert got == list(range(25, 25 + RULE.window // 2))


def test_the_floor_keeps_rounding_wiggles_of_a_flat_gap_out():
    """The BF16 null's gap moves by about 1e-4 per step: without the floor, a 1e-3 wiggle is
    more than 6 robust deviations; with it a spike must stand 0.03 nats above the trend."""
    ref = bf16()
    null = arm(ref, [0.0] * STEPS, noise=1e-4, seed=3)
    null[30] += 1e-3
    assert spike_steps(null, ref) == []
    assert 30 in spike_steps(null, ref, SpikeRule(floor=1e-9))
    null[30] += 0.03
    assert spike_steps(null, ref) == [30]


def test_the_threshold_is_median_plus_k_robust_deviations():
    window = [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09]
    m = statistics.median(window)  # 0.045; |x - m| has median 0.025
    assert RULE.threshold(window) == pytest.approx(m + 6 * 1.4826 * 0.025)
    assert RULE.threshold([0.1] * 10) == pytest.approx(0.1 + 6 * 0.005)  # the floor
    with pytest.raises(ValueError, match=r"window \(1\) must be >= 2"):
        SpikeRule(window=1)


# ---------------------------------------------------------------------------- branch statistics


def branches(spiky: dict[str, list[int]]) -> dict:
    """Records of 3 seeds x 2 points; ``spiky[arm][seed]``: injected spikes in each of the
    seed's branches. Every arm has a gap of 0.05 (no divergence)."""
    out = {}
    for s in range(3):
        ref = bf16(seed=s)
        for p in range(2):
            out[("BF16", s, p)] = {"train_loss": ref, "heldout": {"5": 2.0}, "nonfinite": 0}
            for name, per_seed in spiky.items():
                at = {12 + 5 * i for i in range(per_seed[s])}
                gap = [0.05 + (0.3 if t in at else 0.0) for t in range(STEPS)]
                loss = arm(ref, gap, noise=0.003, seed=10 * s + p)
                out[(name, s, p)] = {"train_loss": loss, "heldout": {"5": 2.05}, "nonfinite": 0}
    return out


def test_per_seed_spike_counts_are_paired_against_low_cost():
    r = branches({"low-cost": [1, 2, 3], "calm": [0, 0, 1]})
    d = Design(seeds=(0, 1, 2), points=(0, 1), horizon=5)
    assert spike_counts(r, d, "low-cost") == [2, 4, 6]  # per seed: both points
    assert spike_counts(r, d, "calm") == [0, 0, 2]
    m, h = spike_difference(r, d, "calm")
    diffs = [-2.0, -4.0, -4.0]
    assert m == pytest.approx(statistics.fmean(diffs))
    assert h == pytest.approx(4.303 * statistics.stdev(diffs) / math.sqrt(3))
    assert spike_difference(r, d, "low-cost", "calm")[0] == pytest.approx(-m)
    assert troubles(r, d, "calm") == (2, 0)


def test_the_table_shows_the_paired_spike_column():
    row = {"unit_steps": 0.1, "vs_bf16": (0.01, 0.002), "vs_low_cost": (-0.02, 0.01)}
    row |= {"closed": (0.5, 0.1), "spikes": 3, "diverged": 0}
    text = table(
        {
            "low-cost": {**row, "spikes_vs_low_cost": None},
            "calm": {**row, "spikes_vs_low_cost": (-1.5, 0.8)},
        }
    )
    assert "| loss spikes | spikes - low-cost (per seed) | diverged |" in text
    assert "| 3 | - | 0 |" in text and "| 3 | -1.5 +- 0.8 | 0 |" in text
