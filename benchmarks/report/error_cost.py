"""The error term's measured cost ``C`` for the cost at matched loss (issue 44): an arm with
``gamma`` measures the error sums every ``error_every`` steps, which :mod:`benchmarks.harness.cost`
prices as ``C / error_every`` of a low-cost step. ``C``: the median per-round CPU-time ratio of
``gnmr+e k`` (``error_every`` 1) to the low-cost path, less 1, in ``results/overhead_error.json``
(GNMR's monitor and controller inside it: an upper bound). A backend not timed gets the largest
figure measured, and the source says so. No torch.
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
