"""The controller against the brute force of policy v2 on docs/algorithm.md's examples and on
edge cases (non-finite norms, a share boundary, a cap that drops the earliest latch): the checks
of ``test_reference_v2.py`` on hand-picked cases instead of random ones."""

from __future__ import annotations

import pytest

from tests.core.brute_v2 import share_fits
from tests.core.test_reference_v2 import (
    INF,
    NAN,
    Case,
    _risk_by_errors,
    check_case,
    needs_v2,
    run_brute,
)


@needs_v2
def test_doc_examples_on_the_controller() -> None:
    # the hand-checked scenarios above, on the real controller
    errors = [
        [0.0, 0.0, 0.0, 2.0],
        [0.0, 2.0, 0.0, 0.0],
        [9.0, 0.0, 0.0, 0.0],
        [9.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
    ]
    norms, cfg = _risk_by_errors(errors)
    cfg |= {
        "latch": {"step": 1},
        "max_active": {"schedule": "step", "start": 2, "end": 1, "steps": 3},
    }
    check_case(Case(4, cfg, [True] * 4, None, None, norms, errors, None, 1))
    norms, cfg = _risk_by_errors([[3.0, 5.0, 4.0]])
    for share in (0.0, 0.5, 0.6, 1.0):
        errors = [[3.0, 5.0, 4.0]]
        case = Case(
            3, cfg | {"max_share": share}, [True] * 3, [1, 6, 3], None, norms, errors, None, 1
        )
        case.total_cost = 10
        check_case(case)


def test_share_boundary_reading() -> None:
    # "the costs are integers, so the share test is exact": s_t is read as the decimal it
    # prints as; the literal float product differs only on boundaries like these
    assert 0.58 * 50 < 29 and share_fits(29, 0.58, 50) and not share_fits(29, 0.58, 50, "float")
    assert 0.7 * 10 == 7 and share_fits(7, 0.7, 10) and not share_fits(8, 0.7, 10)
    assert share_fits(0, 0.0, 10) and not share_fits(1, 0.0, 10) and share_fits(10, 1.0, 10)
    norms, cfg = _risk_by_errors([[5.0]])
    ds = run_brute(1, cfg | {"max_share": 0.58}, norms, [[5.0]], costs=[29], total_cost=50)
    assert ds[0].chosen == [0]


def _latched_expensive_first() -> Case:
    # 0 (cost 6) latched at step 1, 1 (cost 1) at step 2; from step 3 s W = 5: the walk skips
    # 0, which loses its latch, and keeps 1: under the share cap the EARLIEST latched unit can
    # leave first (the Latch prose says "the latest latched go first", true of k_t only)
    errors = [[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]]
    norms, cfg = _risk_by_errors(errors)
    cfg |= {
        "latch": {"step": 1},
        "max_active": 3,
        "max_share": {"schedule": "step", "start": 1.0, "end": 0.5, "steps": 2},
    }
    return Case(3, cfg, [True] * 3, [6, 1, 1], None, norms, errors, None, 2, 10)


def test_share_cap_can_drop_the_earliest_latched() -> None:
    case = _latched_expensive_first()
    ds = run_brute(3, case.config, case.norms, case.errors, costs=case.costs, total_cost=10)
    assert [d.active for d in ds] == [[0], [0, 1], [1], [1]]
    assert ds[2].order == [0, 1] and ds[2].latched == [0, 2, 0]
    # step 4: 0 exceeds again but, unlatched, comes after 1 and does not fit beside it
    assert ds[3].order == [1, 0] and ds[3].latched == [0, 2, 0]


EDGE_CASES = [
    # a non-finite first norm (no history yet) scores +inf; -inf too
    Case(2, {"warmup_steps": 0}, [True, True], None, None,
         [[NAN, 1.0], [1.0, -INF], [2.0, INF], [0.0, 1.0]], None, None, 2),
    # zeros, then a move: +inf; window 1; lock 0; a budget above U
    Case(3, {"warmup_steps": 0, "window": 1, "lock_steps": 0, "max_active": 9}, [True] * 3,
         None, None, [[0.0, 0.0, 1.0]] * 3 + [[1e-30, 0.0, 1.0], [0.0, 5.0, 1.0]], None, None, 3),
    # every lr so far 0: d = 0; then the peak; the condition at exactly d = 0.5
    Case(2, {"max_active": 0, "pinned": {"units": "all", "from": {"lr_decay": 0.5}},
             "warmup_steps": 0}, [True, True], None, [True, False],
         [[1.0, 1.0]] * 6, None, [0.0, 0.0, 1e-3, 1e-3, 5e-4, 2e-3], 4),
    # the earliest latched unit dropped by a shrinking share
    _latched_expensive_first(),
    # a decimal share boundary inside a walk: 29 of 50 at 0.58
    Case(2, {"gamma": 1.0, "warmup_steps": 0, "lock_steps": 0, "max_share": 0.58},
         [True, True], [29, 21], None, [[1.0, 1.0]], [[3.0, 2.0]], None, 1, 50),
]  # fmt: skip


@needs_v2
@pytest.mark.parametrize("index", range(len(EDGE_CASES)))
def test_edge_cases_on_the_controller(index: int) -> None:
    check_case(EDGE_CASES[index])
    check_case(EDGE_CASES[index], resume=True)
