"""The figures of one paper experiment (:mod:`benchmarks.paper`, ``results/<experiment>.json``:
every arm trained in one process, one seed) against issue 8's targets, as RESULTS.md's paper
section words them. No torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.harness.verdicts import TIME_RATIO, TOLERANCE


def figures(r: Mapping[str, Any], reference: str) -> dict[str, Any]:
    """``arms``: each arm's spec and result (paired by name) with ``rel``, its held-out loss over
    the reference arm's (the arm of policy ``reference``) minus 1; ``by``: the arms of the table's
    columns (the static paths, GNMR's, first+last); ``zclip``: the spike guard's arm; ``ratio``:
    GNMR's step time over the static arm's on its low-cost path (``ratio_met``: at most
    :data:`.verdicts.TIME_RATIO`); ``worse``: that static arm's ``rel`` above
    :data:`.verdicts.TOLERANCE` (the claim is tested), ``within``: GNMR's ``rel`` inside it;
    ``claim``: ``reproduced``, ``not reproduced`` or ``not tested``."""
    arms = []
    for spec, res in zip(r["arms"], r["results"], strict=True):
        # the run writes each arm's spec and result in one order; a mismatch is a broken file
        if spec["name"] != res["name"]:
            raise ValueError(f"arm {spec['name']!r} is paired with the result of {res['name']!r}")
        arms.append(spec | res)
    # GNMR at lowered thresholds (``alpha`` set) is listed after the paper's own settings
    arms.sort(key=lambda a: "alpha" in (a.get("controller") or {}))
    ref = next(a for a in arms if a["policy"] == reference)
    for a in arms:
        a["rel"] = a["heldout_loss"] / ref["heldout_loss"] - 1
    gnmr, zclip = (next(a for a in arms if a["policy"] == p) for p in ("gnmr", "zclip"))
    # the claim is judged against the static arm GNMR falls back to, not any static arm
    low = next(a for a in arms if a["policy"] == "static" and a["low_cost"] == gnmr["low_cost"])
    worse, within = low["rel"] > TOLERANCE, abs(gnmr["rel"]) <= TOLERANCE
    ratio = gnmr["step_ms"] / low["step_ms"]
    claim = "not reproduced" if worse and not within else "reproduced" if worse else "not tested"
    # the table's columns: the static paths, GNMR's arms, Megatron's first+last
    policies = {"statics": ("static", "recovery"), "gnmr": ("gnmr",), "first_last": ("first_last",)}
    by = {c: [a for a in arms if a["policy"] in ps] for c, ps in policies.items()}
    return {"arms": arms, "by": by, "reference": ref["name"], "zclip": zclip, "ratio": ratio} | {
        "ratio_met": ratio <= TIME_RATIO,
        "worse": worse,
        "within": within,
        "claim": claim,
    }
