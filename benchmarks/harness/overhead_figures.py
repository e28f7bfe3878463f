"""The figures of ``python -m benchmarks.overhead``'s result files that RESULTS.md words and the
cost model uses. No torch.

The error term's cost ``C`` (issue 44): an arm with ``gamma`` measures the error sums every
``error_every`` steps, which :mod:`benchmarks.harness.cost` prices at ``C / error_every`` of a
low-cost step. ``C`` is ``gnmr+e k``'s (``error_every`` 1) median per-round CPU-time ratio to the
low-cost path, less 1 (GNMR's monitor and controller inside it: an upper bound); a backend the
run did not time gets the largest figure measured, and the source says so.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness.cost import ErrorCost


def error_cost(run: dict[str, Any] | None, backend: str, file: str) -> ErrorCost | None:
    """``C`` for ``backend`` from the error-term run ``run`` (read from ``file``), and where it
    was measured; ``None`` without a run."""
    if run is None:
        return None
    arm = f"gnmr+e k={run['budget']}"
    # a set-up is "<backend> / <runtime>"; C per backend timed
    times = {w.split(" / ")[0]: {a["arm"]: a for a in t} for w, t in run["step_time"].items()}
    c = {w: by[arm]["cpu_ratio"] - 1 for w, by in times.items() if arm in by}
    timed = backend if backend in c else max(c, key=c.__getitem__)
    text = f"results/{file}: {timed}'s {arm} with error_every 1 against its low-cost path, "
    text += f"median CPU-time ratio {1 + c[timed]:.3f}, GNMR's monitor and controller included"
    if timed != backend:
        text = f"not timed on {backend}: the largest figure measured, {text}"
    # a ratio below 1 is timing noise: measuring cannot make a step cheaper
    return ErrorCost(max(c[timed], 0.0), text)


def interval(arm: str) -> int | None:
    """The ``error_every`` ``N`` of an arm called ``gnmr+e/N k=...`` (``None`` for the others)."""
    return int(arm.split("/")[1].split()[0]) if "+e/" in arm else None


def amortized(every_step: float, n: int) -> float:
    """The step-time ratio of measuring every ``n``-th step, from the every-step ratio: its extra
    cost spread over ``n`` steps, ``1 + (r_1 - 1) / n``."""
    return 1 + (every_step - 1) / n
