"""The branch sweeps' arms by name and the figures RESULTS.md reads off a regime's records beside
:mod:`.designs`: an arm's budget and role, the tables' order, the null controls and issue 35's
noise bar over them, the paper regimes' verdict per budget with its controls and the FP4 sweeps'
verdicts at NVIDIA's budget. No torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.harness.branch_stats import Design, Records, paired, share_closed
from benchmarks.harness.branch_stats import verdict as word
from benchmarks.harness.designs import above, reach, verdict

ORDER: tuple[str, ...] = (
    "random",
    "GNMR",
    "GNMR+e",
    "GNMR+e v2",
    "e-only",
    "GNMR+e lean",
    "TE autoswitch",
)
ORDER += ("oracle", "loss oracle", "random wgrad", "GNMR+e wgrad")
"""The budgeted policies in the tables' order (per budget ``k``: ``<policy> k``)."""
FIXED: tuple[str, ...] = (
    "low-cost",
    "recovery",
    "null recovery",
    "null low-cost",
    "NVIDIA last",
    "TE autoswitch",
)
FIXED += ("NVIDIA late", "late fwd")
"""The unbudgeted arms' role prefixes in the tables' order; they come before every budget."""
Report = Mapping[str, Any]
"""An FP4 sweep's report (``results/sweep_fp4_*.json``)."""
NULL_BAR = 1 / 3
"""Issue 35's bar: each null's interval holds 0 and reaches at most this share of the gap."""


def nulls(high: str) -> dict[str, str]:
    """Each null control and the arm it pairs with (the SR seed only in stochastic regimes)."""
    low = {"null low-cost (1e-6)": "low-cost", "low-cost (SR seed 1)": "low-cost"}
    return {f"null {high} (1e-6)": high} | low


def budget(arm: str) -> int | None:
    """``k`` of a budgeted arm (``GNMR+e v2 4``: 4), else ``None``."""
    head, _, tail = arm.rpartition(" ")
    # only a known policy's trailing number is a budget (``NVIDIA last-4`` is a fixed rule)
    return int(tail) if head in ORDER and tail.isdigit() else None


def role(arm: str, high: str) -> str:
    """The arm's name with the recovery arm's replaced by ``recovery``."""
    return "recovery" if arm == high else arm.replace(f"null {high} ", "null recovery ")


def rank(arm: str, high: str = "BF16") -> tuple[int, int, int, str]:
    """The tables' order, total (ties by name: no set's iteration order reaches the document):
    the unbudgeted arms by the first prefix of :data:`FIXED` their role has, then by budget,
    policy."""
    k, arm = budget(arm), role(arm, high)
    # by role, not name: the recovery arm (BF16, FP8, 8-bit) sorts alike in every regime
    if k is not None:
        return 1, k, ORDER.index(arm.rpartition(" ")[0]), arm
    first = [i for i, p in enumerate(FIXED) if arm.startswith(p)]
    return 0, first[0] if first else len(FIXED), 0, arm


def noise_bar(records: Records, d: Design, high: str, arms: Sequence[str]) -> dict[str, Any]:
    """Issue 35's bar at the horizon: the static gap (low-cost - ``high``) resolved, and every
    null of ``arms`` holding 0 and reaching at most :data:`NULL_BAR` of it. ``nulls``: per null
    its ``pair`` (against the arm it copies), ``reach`` / gap and ``fails``."""
    gap, out = paired(records, d, "low-cost", high), []
    for null, ref in nulls(high).items():
        if null in arms:
            pair = paired(records, d, null, ref)
            # no gap at all: any wobble of a null is as large as the effect
            ratio = reach(pair) / abs(gap[0]) if gap[0] else float("inf")
            fails = excludes(pair) or not ratio <= NULL_BAR
            out.append({"name": null.replace(" (1e-6)", ""), "pair": pair, "reach": ratio})
            out[-1] |= {"fails": fails, "excludes": excludes(pair)}
    passes = excludes(gap) and bool(out) and not any(n["fails"] for n in out)
    return {"gap": gap, "resolved": excludes(gap), "nulls": out, "passes": passes}


def excludes(pair: Sequence[float]) -> bool:
    """Whether the 95% interval excludes 0 (one seed, no half-width: it does not)."""
    return word(pair) in ("better", "worse")


def paper_verdicts(
    records: Records, d: Design, arms: Sequence[str], kept: Sequence[str]
) -> list[dict[str, Any]]:
    """Per budget ``k`` of the paper's ``GNMR k`` among ``arms``: :func:`.designs.verdict` over
    ``d`` (``not yet`` where the arm is not among ``kept``, the design's arms), with ``controls``:
    (arm, share of the gap closed) of NVIDIA's rule and of the other policies at ``k``."""
    out = []
    for k in sorted({k for a in arms if a.startswith("GNMR ") and (k := budget(a))}):
        arm = f"GNMR {k}"
        # an arm waiting for seeds has no verdict yet; its controls in the design have shares
        v: dict[str, Any] = {"arm": arm, "word": "not yet"}
        v = verdict(records, d, arm) if arm in kept else v
        beside = [a for a in kept if a.startswith("NVIDIA last") or (budget(a) == k and a != arm)]
        v["controls"] = [(a, share_closed(records, d, a)) for a in beside]
        out.append({"share": None, "vs_high": None, "vs_low": None} | v)
    return out


def fp4_budgets(report: Report) -> list[int]:
    """The budgets of an FP4 sweep's report: those of its ``random k`` arms."""
    return sorted(
        k for a in report["summary"] if a.rpartition(" ")[0] == "random" and (k := budget(a))
    )


def fp4_verdicts(
    nv: Report, mx: Report, st: Report, k: int, every: Sequence[Report]
) -> dict[str, Any]:
    """The FP4 sweeps' verdicts at NVIDIA's budget ``k`` from the reports of NVFP4 (``nv``),
    MXFP4 (``mx``) and the per-tensor stress (``st``): ``GNMR+e k``'s share of the gap closed and
    its verdict against NVIDIA's rule in NVFP4 and the stress (``nv``, ``nv_last``, ``st``,
    ``st_last``); MXFP4's arms whose share lies above 0 (``mx``: arm to share) and whether ``GNMR+e
    k`` ends worse than one of them; per report of ``every`` and budget, GNMR+e against random
    where that is resolved (``vs_random``: regime, budget, word)."""
    e, static = f"GNMR+e {k}", ("low-cost", "BF16", "first+last")

    def said(r: Report, name: str) -> str:
        # a comparison the report did not run has no verdict
        return word(r["comparisons"][name]) if name in r["comparisons"] else "not run"

    # the static paths and the nulls (copies of them) are no policy that could buy back a share
    shares = {a: s["closed"] for a, s in mx["summary"].items() if "null" not in a}
    ups = {a: p for a, p in shares.items() if a not in static and above(p)}
    vs = [
        (r["regime"], b, said(r, f"GNMR+e {b} - random {b}")) for r in every for b in fp4_budgets(r)
    ]
    return {
        "nv": nv["summary"][e]["closed"],
        # the headline comparisons must have run: a missing one is an error, not "not run"
        "nv_last": word(nv["comparisons"][f"{e} - NVIDIA last-{k}"]),
        "st": st["summary"][e]["closed"],
        "st_last": word(st["comparisons"][f"{e} - NVIDIA last-{k}"]),
        "mx": ups,
        "mx_beats_e": any(said(mx, f"{e} - {a}") == "worse" for a in ups),
        "vs_random": [v for v in vs if v[2] in ("better", "worse")],
    }
