"""Side-by-side training arms for the paper's experiments (:mod:`benchmarks.paper.act_quant`,
:mod:`~benchmarks.paper.fp6_fp8`, :mod:`~benchmarks.paper.lora_int8`).

Every arm of an experiment trains the same small Llama from the same initial weights on the same
batches in the same order (one process; CPU) and differs only in its precision policy
(``Arm.policy``). Every arm runs GNMR's monitor and controller, so exceedance rates are measured
on the same scale in every arm; only ``gnmr`` acts on them. ``interleave=True`` steps every arm
in turn, so their step times sample the same stretch of machine load. The ten policies, the
injected faults, the recovery-gap probe and its graded sets: docs/benchmarks.md#harness.

The pieces: :mod:`benchmarks.harness.arms` (``Setup``, ``Arm``, ``Fault``, ``ArmResult``),
:mod:`benchmarks.harness.model` (the Llama, batches, evaluation, faults),
:mod:`benchmarks.harness.training` (``ArmRun``: one arm's training loop) and
:mod:`benchmarks.harness.probes` (the probe records); this module runs an experiment, writes
its JSON and plot (:mod:`benchmarks.harness.verdicts` prints its table and target lines).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness.arms import Arm, ArmResult, Setup
from benchmarks.harness.common import RESULTS, arg_parser, finish_plot, subplots
from benchmarks.harness.model import Batches
from benchmarks.harness.provenance import record
from benchmarks.harness.training import ArmRun, run_arm
from benchmarks.harness.verdicts import table, targets

logger = logging.getLogger(__name__)


def run_experiment(
    name: str, setup: Setup, arms: Sequence[Arm], *, interleave: bool = False
) -> dict[str, Any]:
    """Run every arm, write ``results/<name>.json`` and ``.png``.

    ``interleave``: train all arms at once, one step of each in turn (the order rotating every
    step), instead of one arm after another. Results are the same (every arm still sees the
    same init and batches); step times are fairer on a machine whose load changes, because
    every arm's steps are sampled over the same stretch of wall time.
    """
    train, heldout = Batches(setup.data, setup), Batches(setup.heldout, setup)
    t0 = time.perf_counter()
    if interleave:
        results = _run_interleaved(setup, arms, train, heldout)
        logger.info("%d arms interleaved: %.0f s", len(arms), time.perf_counter() - t0)
    else:
        results = []
        for arm in arms:
            t0 = time.perf_counter()
            results.append(run_arm(setup, arm, train, heldout))
            logger.info("arm %s: %.0f s", arm.name, time.perf_counter() - t0)
    out = {
        "experiment": name,
        "date": time.strftime("%Y-%m-%d"),
        "setup": asdict(setup),
        "arms": [asdict(a) for a in arms],
        "results": [asdict(r) for r in results],
        "interleaved": interleave,
        "provenance": record(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    plot(name, results, RESULTS / f"{name}.png")
    return out


def _run_interleaved(
    setup: Setup, arms: Sequence[Arm], train: Batches, heldout: Batches
) -> list[ArmResult]:
    runs = [ArmRun(setup, arm, heldout) for arm in arms]
    for step in range(1, setup.steps + 1):
        # the order rotates every step: no arm runs first, or after the same neighbour, all run long
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            run.step(step, train)
        if step % setup.eval_every == 0:
            logger.info(
                "step %d: held-out %s", step, " ".join(f"{r.eval_losses[-1]:.3f}" for r in runs)
            )
    return [run.result() for run in runs]


def plot(name: str, results: Sequence[ArmResult], path: Path) -> None:
    """Training loss (moving mean) and held-out loss of every arm against the step."""
    fig, (ax1, ax2) = subplots(1, 2, figsize=(13, 4.5))
    for r in results:
        k = max(1, len(r.losses) // 50)
        smooth = [statistics.fmean(r.losses[max(0, i - k) : i + 1]) for i in range(len(r.losses))]
        ax1.plot(range(1, len(smooth) + 1), smooth, lw=1.2, label=r.name)
        ax2.plot(r.eval_steps, r.eval_losses, marker="o", ms=3, lw=1.2, label=r.name)
    ax1.set(title=f"{name}: training loss (moving mean)", xlabel="step", ylabel="loss")
    ax2.set(title="held-out loss (y zoomed on the later evaluations)", xlabel="step", ylabel="loss")
    lows = [min(r.eval_losses) for r in results]
    # zoomed past the first third: the steep early losses would flatten the differences that matter
    ax2.set_ylim(min(lows) - 0.05, max(r.eval_losses[len(r.eval_losses) // 3] for r in results))
    finish_plot(fig, path)


def experiment_parser(doc: str | None, steps: int) -> argparse.ArgumentParser:
    """A paper experiment's command line: ``--steps``, ``--budget``, ``--threads``, ``--arms``."""
    p = arg_parser(doc)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--budget", type=float, default=0.1, help="max_active / units for GNMR")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--arms", default=None, help="comma-separated subset of arm names")
    return p


def run_chosen(name: str, setup: Setup, arms: Sequence[Arm], only: str | None) -> dict[str, Any]:
    """:func:`run_experiment`, interleaved, on the arms named in the comma-separated ``only``
    (``--arms``; every arm without it)."""
    if only:
        keep = {x.strip() for x in only.split(",")}
        arms = [a for a in arms if a.name in keep]
    return run_experiment(name, setup, arms, interleave=True)


def report(out: dict[str, Any], reference: str, low_cost: str, gnmr: str | None = None) -> None:
    """Log the table and, given ``gnmr``, the target lines of :func:`run_experiment`'s ``out``
    (arms left out by ``--arms`` are skipped)."""
    results = [ArmResult(**r) for r in out["results"]]
    names = [r.name for r in results]
    # --arms may leave the reference out; the table still needs a column to compare with
    ref = reference if reference in names else names[0]
    low = low_cost if low_cost in names else names[0]
    logger.info(table(results, ref, low))
    if gnmr is not None and {reference, low_cost, gnmr} <= set(names):
        logger.info("\n" + targets(results, reference, low_cost, gnmr))
