"""A step DeepSpeed skips on overflow leaves the GNMR controller untouched (real DeepSpeed, CPU).

DeepSpeed 0.19's ZeRO 1-2 optimizer skips a step whose gradients hold an inf/NaN:
``DeepSpeedZeroOptimizer.step`` sets ``overflow`` (fp32: the global norm is not finite; bf16:
``bf16.check_grad_overflow``, on by default), all-reduced over the data-parallel group, and
``engine._take_model_step`` reports it through ``engine.was_step_applied()``. Here rank 0 alone
turns one gradient into NaN at step :data:`SKIP`, so every rank skips that step (fp16, the
usual source of skips, is refused on these CPUs).

The run with the skipped step is compared with a run that never saw that batch: the GNMR state
(controller histories, locks, step count, plan, carried error score), the last decision and the
trace must be exactly as before the skip, and every later decision, risk, norm and parameter
exactly those of the run without it. ``gamma`` is on, so a skipped step that leaked its error
sums (measured during its forward and backward) into the next step would change that step's
error scores ``e``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.requires import require

require("deepspeed")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

GNMR = dsc.gnmr_block(lock_steps=3, gamma=0.5)
SPIKE, SKIP, LAST = 8, 9, 12
"""A gradient spike at step 8 selects a unit (so a plan and a lock are held at the skip), rank 0's
NaN gradient at step 9 makes DeepSpeed skip it, steps 10-12 run after it."""
CONFIGS = [(1, "fp32"), (2, "bf16")]


def _state(gnmr) -> dict:
    """Everything of the session that a decision changes, as plain picklable values."""
    leave = ("checksum", "skipped", "accounting", "skipped_pending")  # these count the skip
    body = {k: v for k, v in gnmr.state_dict().items() if k not in leave}
    d = gnmr.last_decision
    interval = gnmr.interval
    errors = gnmr.runtime._last_errors
    return {
        "body": body,
        "plan": (gnmr.plan.step, sorted(gnmr.plan.active), gnmr.plan.names),
        "decision_id": id(d),
        "decision": (d.step, d.active, d.risk.clone(), d.error.clone()),
        "norms_id": id(gnmr.runtime.last_norms),
        "last_errors": None if errors is None else errors.clone(),
        "interval": (
            (interval.steps, interval.last_step, interval.skipped, dict(interval.sums)),
            {u: list(steps) for u, steps in interval.recovered.items()},  # copies: kept as now
        ),
        "telemetry": {k: v for k, v in gnmr.telemetry().items() if k != "skipped_steps"},
        "backend_plan": (gnmr.backend.report().step, gnmr.backend.report().planned),
        "skipped_nonfinite": gnmr.summary().skipped_nonfinite.tolist(),
    }


def _worker(rank, world, trace_dir):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    out = {}
    for stage, dtype in CONFIGS:
        for with_skip in (True, False):
            trace = f"{trace_dir}/{stage}-{dtype}-{with_skip}.jsonl"
            cfg = dsc.ds_config(stage, dtype, {**GNMR, "log": {"trace": trace}})
            engine, *_ = gds.initialize(model=dsc.llama(), config=cfg)
            gnmr, layers = engine.gnmr, engine.module.model.layers
            spike, poison = layers[1].mlp.up_proj.weight, layers[0].self_attn.q_proj.weight
            steps, snaps = [], {}
            for step in range(1, LAST + 1):
                if step == SKIP and not with_skip:
                    continue  # the run that never saw the skipped batch
                hooks = []
                if step == SPIKE:
                    hooks.append(spike.register_hook(lambda g: g * 50))
                if step == SKIP and rank == 0:
                    hooks.append(poison.register_hook(lambda g: torch.full_like(g, math.nan)))
                if step == SKIP:
                    snaps["before"] = _state(gnmr)
                tokens = dsc.batch(step, rank)
                loss = engine(input_ids=tokens, labels=tokens).loss
                ran = gnmr.backend.report()  # the paths this step's forward ran
                engine.backward(loss)
                engine.step()
                for h in hooks:
                    h.remove()
                if step == SKIP:
                    snaps["after"] = _state(gnmr)
                d = gnmr.last_decision
                steps.append(
                    {
                        "batch": step,
                        "applied": engine.was_step_applied(),
                        "ds_skipped": engine.skipped_steps,
                        "gnmr_skipped": gnmr.skipped,
                        "count": gnmr.controller.step_count,
                        "decision": (d.step, d.active, d.risk.clone(), d.error.clone()),
                        "norms": gnmr.runtime.last_norms.norms.clone(),
                        "ran": (ran.step, ran.planned, ran.recovered),
                    }
                )
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            out[stage, dtype, with_skip] = {"steps": steps, "snaps": snaps, "params": params}
    return out


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def test_a_skipped_step_leaves_the_controller_untouched_and_the_next_step_proceeds(tmp_path):
    from gnmr_dist.telemetry import read_trace

    results = multiproc.run(_worker, 2, str(tmp_path))
    for cfg in CONFIGS:
        for rank, res in enumerate(results):
            skipped, clean = res[(*cfg, True)], res[(*cfg, False)]
            at = SKIP - 1  # index of the skipped batch in the run that has it
            s = skipped["steps"]
            # the premise: DeepSpeed skipped that step, on every rank, and only that one
            assert [r["applied"] for r in s] == [r["batch"] != SKIP for r in s], (cfg, rank)
            assert [r["ds_skipped"] for r in s] == [int(r["batch"] >= SKIP) for r in s]
            assert [r["gnmr_skipped"] for r in s] == [int(r["batch"] >= SKIP) for r in s]
            # not vacuous: at the skip a plan and a lock were held, and the step ran that plan
            before, after = skipped["snaps"]["before"], skipped["snaps"]["after"]
            assert before["plan"][1] and bool((before["body"]["controller"]["lock"] > 0).any())
            assert s[at]["ran"][2] == frozenset(before["plan"][1]), (cfg, rank)
            # the skipped step changed nothing GNMR decides with, and took no decision; the
            # accounting counted its non-finite unit (q_proj of layer 0, unit 0)
            counted = after.pop("skipped_nonfinite")
            assert before.pop("skipped_nonfinite") == [0] * 14 and counted == [1] + [0] * 13
            # ... and Trainer's interval counts the skipped attempt and its non-finite unit
            (steps, last, skips, sums), units = before.pop("interval")
            sums["num_nonfinite"] += 1
            assert after.pop("interval") == ((steps, last, skips + 1, sums), units)
            assert _same(before, after), (cfg, rank)
            assert before["body"]["controller"]["step"] == SKIP - 1 == s[at]["count"]
            assert s[at]["decision"][0] == SKIP - 1  # the last decision is still step 8's
            # the next applied step is decision SKIP, and from there the run is the one that
            # never saw the skipped batch: same decisions, risks, norms, plans and parameters
            assert s[at + 1]["count"] == SKIP and s[at + 1]["decision"][0] == SKIP
            assert s[at + 1]["ran"][0] == SKIP  # it ran the plan made for step SKIP
            kept = s[:at] + s[at + 1 :]
            keys = ("decision", "norms", "ran", "count")
            assert len(kept) == len(clean["steps"]) == LAST - 1
            for got, want in zip(kept, clean["steps"], strict=True):
                assert got["batch"] == want["batch"]
                assert _same({k: got[k] for k in keys}, {k: want[k] for k in keys}), (cfg, got)
            assert _same(skipped["params"], clean["params"]), cfg
        assert _same(results[0][(*cfg, True)]["steps"], results[1][(*cfg, True)]["steps"])
        # the trace has one record per applied step: no record, and no step number, for the skip
        _, norms, records = read_trace(tmp_path / f"{cfg[0]}-{cfg[1]}-True.jsonl")
        assert [r["step"] for r in records] == list(range(1, LAST))
        engine_steps = [r["extra"]["engine_step"] for r in records]  # DeepSpeed counts the skip
        assert engine_steps == [*range(1, SKIP), *range(SKIP + 1, LAST + 1)]
        assert bool(torch.isfinite(norms).all())
        # ... and the record of the retried step names the skipped attempt's non-finite unit
        first = {"step": SKIP, "unit": 0, "name": dsc.unit_names()[0], "skipped": True}
        assert records[SKIP - 1]["skipped_nonfinite"] == [0]
        assert records[SKIP - 1]["first_nonfinite"] == first
        assert all("skipped_nonfinite" not in r for r in records if r["step"] != SKIP)
