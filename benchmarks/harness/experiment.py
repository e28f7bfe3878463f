"""Side-by-side training arms for the seed experiments (:mod:`benchmarks.seed.act_quant`,
:mod:`~benchmarks.seed.fp6_fp8`, :mod:`~benchmarks.seed.lora_int8`).

Every arm of an experiment trains the same small Llama from the same initial weights on the same
batches in the same order (one process; CPU), and differs only in its precision policy:

- ``full``: no backend: every projection in full precision (FP32 here; BF16 on a GPU);
- ``static``: the backend on every unit, always the low-cost path (GNMR's budget is 0);
- ``recovery``: the backend on every unit, always the recovery path (the "8-bit" / "FP8" arm);
- ``gnmr``: the backend's low-cost path, and GNMR moves at most ``max_active`` units to the
  recovery path for the next step;
- ``first_last``: Megatron's static recipe -- the first and the last transformer layer always on
  the recovery path, every other unit on the low-cost path;
- ``zclip``: the low-cost path everywhere plus a ZClip-style global gradient-norm spike guard
  (an EMA of the global norm's mean and variance; a norm whose z-score exceeds ``z_thresh`` is
  clipped to ``mean + z_thresh * std``; Kumar et al., 2025), the global guard users pick today;
- ``random``: ``max_active`` eligible units on the recovery path, re-drawn every step (a
  generator seeded by ``Setup.seed``): the control every budgeted policy must beat;
- ``last_units``: NVIDIA's static rule -- the last ``max_active`` units (in the model's order:
  the last projections of the last layer) always on the recovery path;
- ``late``: NVIDIA's other rule -- every unit on the low-cost path, then on the recovery path
  for the run's last ``Arm.late_steps`` steps;
- ``oracle``: every step, the recovery-gap probe measures every unit's gap on the step's own
  weights and batch first, and the ``max_active`` eligible units with the largest gap
  (``Arm.oracle_by``: gradient or update gap) run the recovery path: the upper bound of any
  selection at that budget (it costs two extra forward/backward passes per step).

``gnmr`` with ``controller={"gamma": ...}`` is GNMR with docs/algorithm.md#damage-term's error term:
the backend tracks its error sums and the runtime hands the controller their relative score.

``Setup.faults`` inject local, transient trouble by construction (:class:`Fault`): one input
channel (or the whole input) of one projection multiplied by a factor for a window of steps,
in every arm alike (probe passes included), so that the true gradient changes the same way and
only the precision policy differs.

Every arm runs the GNMR monitor and controller (GNMR's own policy), so exceedance rates -- the
fraction of eligible unit-steps whose risk ``max(GNMR/alpha_t, dGNMR/beta_t)`` is above 1 after
warm-up -- are measured on the same scale in every arm; only the ``gnmr`` arm acts on them. The
recovery rate is the fraction of eligible unit-steps whose forward actually ran the recovery
path (read from the backend's report, not from the plan).

Step times are wall-clock times of forward + backward + monitor + optimizer step (evaluations
excluded); arms run one after another, or with ``run_experiment(..., interleave=True)`` one step
of each arm in turn (every arm then samples the same stretch of machine load), so compare them
within one run of a command only. ``Arm.save_to`` keeps an arm's final weights (a base model
that ``Setup.init_from`` loads in a later experiment).

``Arm(probe_every=N)`` (any arm with a backend) runs the recovery-gap probe
(:class:`gnmr_dist.distributed.probe.RecoveryProbe`) on every N-th step, after the step's plan is
applied and before its forward, on the same weights and batch: two extra forward/backward
passes, every unit on the low-cost and on the recovery path. The step itself is unchanged (same
RNG, plan, gradients and decisions as without the probe) and its recorded time excludes the
probe, whose own time is kept apart (``ArmResult.probe_ms``). Each probe step records the
controller's risk at that step (scored from the same gradient the probe measured), the sets
below, and their selection figures (:func:`gnmr_dist.telemetry.selection.set_figures`: precision
against the top-|set| grad / update gaps and the share of the squared gaps covered):

- ``risk_topk``: the top ``probe_k`` units by this step's risk (precision@k of the risk);
- ``active``: the units that ran the recovery path during the step (the plan);
- ``decided``: the controller's new active set (chosen from this step's risk, runs next step);
- ``random``: ``probe_k`` eligible units drawn with a generator seeded by ``Setup.seed``;
- ``first_last``: the units of the first and the last layer (Megatron's recipe);
- ``oracle_grad`` / ``oracle_update``: the top ``probe_k`` by measured grad / update gap (the
  upper bound of any k-set: a precision of 1 and the largest share, checked at every probe).

The pieces: :mod:`benchmarks.harness.arms` (``Setup``, ``Arm``, ``Fault``, ``ArmResult``),
:mod:`benchmarks.harness.model` (the Llama, batches, evaluation, faults),
:mod:`benchmarks.harness.training` (``ArmRun``: one arm's training loop) and
:mod:`benchmarks.harness.probes` (the probe records); this module runs an experiment, writes
its JSON and plot (:mod:`benchmarks.harness.verdicts` prints its table and target lines).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness.arms import Arm, ArmResult, Setup
from benchmarks.harness.common import RESULTS
from benchmarks.harness.model import Batches
from benchmarks.harness.provenance import record
from benchmarks.harness.training import ArmRun, run_arm

logger = logging.getLogger("benchmarks.harness.experiment")


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
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            run.step(step, train)
        if step % setup.eval_every == 0:
            logger.info(
                "step %d: held-out %s", step, " ".join(f"{r.eval_losses[-1]:.3f}" for r in runs)
            )
    return [run.result() for run in runs]


def plot(name: str, results: Sequence[ArmResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in results:
        k = max(1, len(r.losses) // 50)
        smooth = [statistics.fmean(r.losses[max(0, i - k) : i + 1]) for i in range(len(r.losses))]
        ax1.plot(range(1, len(smooth) + 1), smooth, lw=1.2, label=r.name)
        ax2.plot(r.eval_steps, r.eval_losses, marker="o", ms=3, lw=1.2, label=r.name)
    ax1.set(title=f"{name}: training loss (moving mean)", xlabel="step", ylabel="loss")
    ax2.set(title="held-out loss (y zoomed on the later evaluations)", xlabel="step", ylabel="loss")
    lows = [min(r.eval_losses) for r in results]
    ax2.set_ylim(min(lows) - 0.05, max(r.eval_losses[len(r.eval_losses) // 3] for r in results))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
