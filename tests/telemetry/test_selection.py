"""Selection-quality figures against hand-computed examples (scipy is not installed here:
Spearman's rho is checked against scipy's documented example and the no-ties formula)."""

from __future__ import annotations

import math

import pytest
import torch

from gnmr_dist.telemetry.selection import (
    average_ranks,
    gap_share,
    precision_at_k,
    set_figures,
    set_precision,
    spearman,
    top_k,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_top_k_breaks_ties_by_id_and_reads_nan_as_infinity():
    assert top_k(t(1, 3, 3, 2), 1) == {1}
    assert top_k(t(1, 3, 3, 2), 2) == {1, 2}
    assert top_k(t(1, 3, 3, 2), 3) == {1, 2, 3}
    assert top_k(t(5, 5, 5, 5), 2) == {0, 1}
    assert top_k(t(1, math.nan, math.inf, 2), 2) == {1, 2}
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 4\]"):
        top_k(t(1, 2, 3, 4), 5)
    with pytest.raises(ValueError, match="k must be"):
        top_k(t(1, 2, 3, 4), 0)


def test_precision_at_k_by_hand():
    scores, gaps = t(0.9, 0.1, 0.8, 0.3, 0.5), t(5, 4, 1, 3, 2)
    # top-2 scores {0, 2}, top-2 gaps {0, 1}: one in common
    assert precision_at_k(scores, gaps, 2) == 0.5
    # top-3 scores {0, 2, 4}, top-3 gaps {0, 1, 3}
    assert precision_at_k(scores, gaps, 3) == pytest.approx(1 / 3)
    assert precision_at_k(gaps, gaps, 3) == 1.0
    assert precision_at_k(scores, gaps, 5) == 1.0
    # equal scores: the controller's order picks ids 0, 1; gaps' top-2 is {3, 4}
    assert precision_at_k(t(1, 1, 1, 1, 1), t(0, 0, 0, 2, 1), 2) == 0.0
    with pytest.raises(ValueError, match="one entry per unit"):
        precision_at_k(t(1, 2), t(1, 2, 3), 1)


def test_set_precision_by_hand():
    gaps = t(5, 4, 1, 3, 2)
    assert set_precision({1, 3}, gaps) == 0.5  # top-2 gaps {0, 1}
    assert set_precision({1, 3}, gaps, k=4) == 0.5  # top-4 {0, 1, 3, 4}: 2 of 4
    assert set_precision([0, 1, 3], gaps) == 1.0
    assert math.isnan(set_precision(set(), gaps))


def test_gap_share_by_hand():
    gaps = t(3, 4, 0)
    assert gap_share({1}, gaps) == pytest.approx(16 / 25)
    assert gap_share({0, 2}, gaps) == pytest.approx(9 / 25)
    assert gap_share({0, 1, 2}, gaps) == 1.0
    assert gap_share(set(), gaps) == 0.0
    assert math.isnan(gap_share({0}, t(0, 0, 0)))
    with pytest.raises(ValueError, match=r"chosen ids must be in \[0, 2\]"):
        gap_share({3}, gaps)


def test_top_k_of_the_gaps_has_the_largest_share_of_any_k_set():
    gen = torch.Generator().manual_seed(0)
    gaps = torch.rand(12, generator=gen, dtype=torch.float64)
    for k in (1, 3, 6):
        best = gap_share(top_k(gaps, k), gaps)
        for _ in range(50):
            other = set(torch.randperm(12, generator=gen)[:k].tolist())
            assert gap_share(other, gaps) <= best + 1e-15


def test_average_ranks_share_ties():
    assert average_ranks(t(10, 20, 20, 5)).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert average_ranks(t(1, math.nan, math.inf)).tolist() == [1.0, 2.5, 2.5]


def test_spearman_matches_scipys_example_and_the_no_ties_formula():
    # scipy.stats.spearmanr([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) = 0.8207826816681233 (its docs);
    # by hand: ranks [1..5] and [1, 2, 3.5, 5, 3.5] -> 8 / sqrt(10 * 9.5)
    rho = spearman(t(1, 2, 3, 4, 5), t(5, 6, 7, 8, 7))
    assert rho == pytest.approx(8 / math.sqrt(95), rel=1e-12)
    assert rho == pytest.approx(0.8207826816681233, rel=1e-12)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, generator=gen), torch.randn(20, generator=gen)
    d = (average_ranks(x) - average_ranks(y)).square().sum()
    assert spearman(x, y) == pytest.approx(1 - 6 * float(d) / (20 * (20**2 - 1)), rel=1e-12)
    assert spearman(x, x.exp()) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert math.isnan(spearman(t(1, 1, 1), t(1, 2, 3)))


def test_set_figures_collects_the_four_figures():
    grad, update = t(5, 4, 1, 3, 2), t(1, 2, 3, 4, 5)
    figures = set_figures({0, 3}, grad, update)
    assert figures == {
        "precision_grad": 0.5,  # top-2 grad gaps {0, 1}
        "precision_update": 0.5,  # top-2 update gaps {3, 4}
        "share_grad": pytest.approx(34 / 55),
        "share_update": pytest.approx(17 / 55),
    }
