"""The error term's measured cost, for the cost at matched loss (issue 44).

An arm with ``gamma`` measures the error sums ``B(u)`` every ``error_every`` steps
(docs/algorithm.md#damage-term); :mod:`benchmarks.harness.cost` adds that cost to its step time
as ``C / error_every``, ``C`` the extra time of one measuring step as a share of a low-cost step.
``C`` is read here from the step-time run of the error term (``results/overhead_error.json``,
:mod:`benchmarks.overhead.step_time`): the median per-round CPU-time ratio of ``gnmr+e k``
(``error_every`` 1) to the low-cost path without GNMR, less 1. GNMR's monitor and controller are
inside that ratio, so it bounds the term's own cost from above. A backend the run did not time
(``torchao_fp8``, ``int8``) is priced at the largest figure it measured, and the source says so.
No torch.
"""

from __future__ import annotations

from benchmarks.harness import cost
from benchmarks.report.source import Source

__all__ = ["FILE", "error_cost"]

FILE = "overhead_error"
"""The result file of the error term's step time (under ``results/``)."""


def _measured(src: Source) -> tuple[str, dict[str, float]]:
    """(the arm timed, ``C`` by backend) from :data:`FILE` (nothing without the file)."""
    if not src.has(f"{FILE}.json"):
        return "", {}
    r = src.json(FILE)
    arm = f"gnmr+e k={r['budget']}"
    out = {}
    for where, rows in r["step_time"].items():
        x = next((a for a in rows if a["arm"] == arm), None)
        if x is not None:
            out[where.split(" / ")[0]] = float(x["cpu_ratio"]) - 1
    return arm, out


def error_cost(src: Source, backend: str) -> cost.ErrorCost | None:
    """``C`` for ``backend`` and where it was measured; the largest measured figure for a backend
    the run did not time; ``None`` when nothing was measured."""
    arm, measured = _measured(src)
    if not measured:
        return None
    timed = backend if backend in measured else max(measured, key=measured.__getitem__)
    share = max(measured[timed], 0.0)
    text = (
        f"results/{FILE}.json: {timed}'s {arm} with error_every 1 against its low-cost path, "
        f"median CPU-time ratio {1 + measured[timed]:.3f}, GNMR's monitor and controller included"
    )
    if timed != backend:
        text = f"not timed on {backend}: the largest figure measured, {text}"
    return cost.ErrorCost(share, text)
