"""Issue 34 under megatron-core at TP2 (2 gloo processes, a loop of its own): the accounting of a
non-finite gradient, and the second policy's budgets on every rank.

(a) A NaN in one unit's gradient shard on ONE tensor-parallel rank reaches the controller
    (fp32: megatron applies the step; the harness then puts the weights back, as a skipped step
    would have left them), and a second NaN on the other rank is an fp16-style overflow that
    megatron skips (its ``prepare_grads`` reports the inf, as a grad scaler's reduced check
    does). Every rank logs the same one line naming the first unit and step, the trace and the
    scalars record both, the summary counts both, and a run resumed from a checkpoint (the GNMR
    state through ``torch.load(weights_only=True)``, the weights of each rank) ends with the
    uninterrupted run's counts, decisions and trace.
(b) A ``max_active`` schedule on the learning-rate clock fed by megatron's own scheduler,
    ``max_share`` over an fprop+dgrad subset, a latch and pinned last layer: the decisions are
    the same on every rank (``check_consistency``) and equal those of an offline controller fed
    the trace's norms and learning rates with costs computed here from the TP1 model's shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.requires import require

require("megatron.core")

from tests import multiproc
from tests.integrations.megatron.settings import PRELOAD

pytestmark = pytest.mark.slow


NAN_AT, SKIP_AT, SAVE_AT, ITERS = 4, 8, 6, 11
"""(a): the iteration of the NaN the controller sees, of the NaN megatron skips, of the
checkpoint, and the last one (iterations are megatron's: the skip takes no controller step)."""
NAN_UNIT = "decoder.layers.1.mlp.linear_fc1"  # column-parallel: TP rank 1's shard
SKIP_UNIT = "decoder.layers.2.self_attention.linear_proj"  # row-parallel: TP rank 0's shard
FIRST = "gnmr: first non-finite gradient norm of the run"


class _Board:
    """A stand-in for megatron's TensorBoard writer: every ``add_scalar`` call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.append((tag, float(value), int(step)))


class _Lines:
    """The WARNING records of the ``gnmr_dist`` loggers of this process, as text."""

    def __init__(self) -> None:
        import logging

        self.lines: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: self.lines.append(record.getMessage())  # type: ignore
        logging.getLogger("gnmr_dist").addHandler(handler)


def _start(block: dict, optimizer=None):
    """``(chunks, optimizer, handle, full)``: the tiny GPT at TP2 (fp32, plain optimizer)
    with GNMR applied."""
    import warnings

    import megatron_patches
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import settings

    warnings.filterwarnings("ignore")
    enable_cpu_compat()
    with settings.full_layout():
        full = settings.full_model()
    chunks, opt = settings.build(settings.Setting("tp2", tp=2), full, optimizer)
    return chunks, opt, megatron_patches.enable(chunks, block, optimizer=opt), full


def _shard_grad(handle, name: str) -> torch.Tensor:
    return handle.registry.local_modules[handle.registry.index[name]].weight.main_grad


# --------------------------------------------------------------------------- (a)


def _nan_worker(rank, world, block, folder, resume):
    """Train ITERS iterations (from SAVE_AT when ``resume``), the two NaNs injected; returns
    this rank's log lines, decisions, summary, summary lines, scalars and trace records."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patches import Reporter
    from tests.integrations.megatron import settings

    lines = _Lines()
    sgd = OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.0, clip_grad=1.0)
    chunks, opt, handle, _ = _start(block, sgd)
    tp_rank, folder = ps.get_tensor_model_parallel_rank(), Path(folder)
    start = 0
    if resume:
        weights = torch.load(folder / f"weights_{rank}.pt", weights_only=True)
        for chunk, state in zip(chunks, weights, strict=True):
            chunk.load_state_dict(state)
        handle.load_state_dict(torch.load(folder / "gnmr.pt", weights_only=True))
        start = SAVE_AT
    reporter = Reporter(handle.block, handle, source="test")
    board = _Board() if rank == world - 1 else None  # megatron's writers: on the last rank
    params = [p for c in chunks for p in c.parameters()]
    prepare = opt.prepare_grads
    decisions = []
    for it in range(start + 1, ITERS + 1):
        settings.train_step(chunks, it)
        if it == NAN_AT and tp_rank == 1:
            _shard_grad(handle, NAN_UNIT)[0, 0] = float("nan")
        if it == SKIP_AT and tp_rank == 0:
            _shard_grad(handle, SKIP_UNIT)[1, 1] = float("nan")
        opt.prepare_grads = (lambda: prepare() or True) if it == SKIP_AT else prepare
        before = [p.detach().clone() for p in params] if it == NAN_AT else None
        opt.step()
        if before is not None:  # the weights of the step with the NaN, put back
            with torch.no_grad():
                for p, b in zip(params, before, strict=True):
                    p.copy_(torch.where(torch.isfinite(p), p, b))
        if reporter.record(handle, it, writers=(board, None)):
            d = handle.last_decision
            decisions.append((d.step, d.active, d.candidates, d.risk.tolist()))
        if it == SAVE_AT and not resume:
            torch.save([c.state_dict() for c in chunks], folder / f"weights_{rank}.pt")
            if rank == 0:
                torch.save(handle.state_dict(), folder / "gnmr.pt")
    summary_lines = reporter.finish(handle)
    reporter.close()
    trace = Path(block["log"]["trace"]).read_text() if rank == 0 else None
    ps.destroy_model_parallel()
    return {
        "lines": lines.lines,
        "decisions": decisions,
        "summary": handle.summary().as_dict(handle.registry.names),
        "summary_lines": summary_lines,
        "scalars": board.calls if board is not None else None,
        "trace": trace,
        "names": handle.registry.names,
    }


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("megatron_nan")
    block = {
        "max_active": 2,
        "warmup_steps": 2,
        "lock_steps": 2,
        "alpha": 1.5,
        "log": {"trace": str(folder / "trace.jsonl"), "console": False},
    }
    jobs = [(_nan_worker, 2, (block, str(folder), resume)) for resume in (False, True)]
    full, resumed = multiproc.run_jobs(jobs, preload=PRELOAD)
    return full, resumed, (folder / "trace.jsonl").read_text()


def _records(text: str) -> tuple[dict, list[dict]]:
    rows = [json.loads(line) for line in text.splitlines()]
    return rows[0], rows[1:]


def test_a_nan_on_one_tp_rank_is_named_alike_in_every_ranks_log(nan_runs):
    full, _, _ = nan_runs
    names = full[0]["names"]
    nan_id = names.index(NAN_UNIT)
    want = (
        f"{FIRST} at step {NAN_AT}: unit {nan_id} {NAN_UNIT} (nan; 1 of {len(names)} units "
        "non-finite)"
    )
    for rank in full:
        assert [line for line in rank["lines"] if FIRST in line] == [want]
        skipped = [line for line in rank["lines"] if "megatron skipped the update" in line]
        assert skipped == [
            f"gnmr: megatron skipped the update of step {SKIP_AT} (non-finite norms in 1 of "
            f"{len(names)} units); controller history untouched"
        ]
        assert rank["decisions"] == full[0]["decisions"]  # the same decisions on both ranks


def test_the_trace_scalars_and_summary_count_both_nans(nan_runs):
    from gnmr_dist.core import GNMRConfig
    from gnmr_dist.telemetry.trace import TraceHeader, read_accounting

    full, _, _ = nan_runs
    names = full[0]["names"]
    nan_id, skip_id = names.index(NAN_UNIT), names.index(SKIP_UNIT)
    head, records = _records(full[0]["trace"])
    assert [r["step"] for r in records] == list(range(1, ITERS))  # the skip took no step
    first = {"step": NAN_AT, "unit": nan_id, "name": NAN_UNIT, "skipped": False}
    marked = {r["step"]: {k: r[k] for k in r if "nonfinite" in k} for r in records}
    # the skipped attempt of step SKIP_AT is recorded with the decision of that step
    assert {s: m for s, m in marked.items() if m} == {
        NAN_AT: {"nonfinite": [nan_id], "first_nonfinite": first},
        SKIP_AT: {"skipped_nonfinite": [skip_id]},
    }
    assert [r["lr"] for r in records] == [0.05] * (ITERS - 1)
    assert nan_id in records[NAN_AT - 1]["active"]  # risk +inf: on the recovery path next
    # the summary, identical on every rank, against the trace's own recount
    summary = full[0]["summary"]
    assert all(r["summary"] == summary for r in full)
    config = GNMRConfig.from_dict(head["config"])
    header = TraceHeader(tuple(head["units"]), tuple(head["eligible"]), config, head["meta"])
    recount = read_accounting(header, records)
    per_unit = summary["per_unit"]
    assert {n: e["nonfinite"] for n, e in per_unit.items() if e["nonfinite"]} == {
        NAN_UNIT: 1,
        SKIP_UNIT: 1,
    }
    assert [per_unit.get(n, {}).get("nonfinite", 0) for n in names] == recount["nonfinite"]
    assert [per_unit.get(n, {}).get("recovered", 0) for n in names] == recount["recovered"]
    assert summary["steps"] == ITERS - 1 and summary["skipped_nonfinite_unit_steps"] == 1
    assert summary["first_nonfinite"] == first
    recovered = sum(recount["recovered"])
    assert recovered > 0 and summary["recovered_unit_steps"] == recovered
    assert summary["recovered_share"] == recovered / (len(names) * (ITERS - 1))
    assert full[0]["summary_lines"][1] == (
        "gnmr: non-finite gradient norms in 2 unit-steps (1 on steps the framework skipped); "
        f"first at step {NAN_AT}: unit {nan_id} {NAN_UNIT}"
    )
    # megatron's writer (last rank): per unit only when its count changes, never a zero
    scalars = full[1]["scalars"]
    per_unit_tags = [(t, v, i) for t, v, i in scalars if t.startswith("gnmr/accounting/nonfinite/")]
    assert per_unit_tags == [
        (f"gnmr/accounting/nonfinite/{NAN_UNIT}", 1.0, NAN_AT),
        (f"gnmr/accounting/nonfinite/{SKIP_UNIT}", 1.0, SKIP_AT + 1),
    ]
    assert all(v > 0 for t, v, _ in scalars if t.startswith("gnmr/accounting/recovered/"))
    last = {t: v for t, v, i in scalars if i == ITERS}
    assert last["gnmr/accounting/recovered_share"] == summary["recovered_share"]
    assert last["gnmr/accounting/nonfinite_unit_steps"] == 2.0
    assert last["gnmr/accounting/first_nonfinite_step"] == NAN_AT


def test_a_resume_keeps_the_counts(nan_runs):
    full, resumed, trace_after = nan_runs
    for a, b in zip(full, resumed, strict=True):
        assert b["summary"] == a["summary"]
        assert b["decisions"] == a["decisions"][SAVE_AT:]
        assert not [line for line in b["lines"] if FIRST in line]  # named once, in the run
        assert b["summary_lines"] == a["summary_lines"]
    assert trace_after == full[0]["trace"]  # the resumed run continued the same file


# --------------------------------------------------------------------------- (b)

STEPS = 16
SPIKES = {
    5: ("decoder.layers.0.mlp.linear_fc1", 40.0),
    7: ("decoder.layers.2.self_attention.linear_qkv", 40.0),
    9: ("decoder.layers.1.mlp.linear_fc2", 40.0),
    10: ("decoder.layers.0.self_attention.linear_proj", 40.0),
    12: ("decoder.layers.2.mlp.linear_fc1", 40.0),
    13: ("decoder.layers.1.self_attention.linear_qkv", 40.0),
}
"""Iteration: (unit, factor) of the spikes, on TP rank 1's shard."""

POLICY = {
    "max_active": {"schedule": "step", "start": 1, "end": 3, "clock": "lr_decay", "to": 0.4},
    "max_share": 0.1,
    "latch": {"lr_decay": 0.4},
    "pinned": {"units": {"last_layers": 1}, "from": {"lr_decay": 0.7}},
    "warmup_steps": 2,
    "lock_steps": 2,
    "alpha": 1.3,
    "beta": 1.5,
}
GEMMS = ["fprop", "dgrad"]


def _budget_worker(rank, world, block):
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_patches import Reporter
    from tests.integrations.megatron import settings

    adam = dataclasses.replace(settings.optimizer_config(settings.Setting("tp2", tp=2)), min_lr=0.0)
    chunks, opt, handle, full = _start(block, adam)
    scheduler = OptimizerParamScheduler(
        opt, 0.0, 1e-3, 0.0, 2, STEPS, "linear", 0.0, 0.0, STEPS, "constant"
    )
    reporter = Reporter(handle.block, handle, source="test")
    tp_rank = ps.get_tensor_model_parallel_rank()
    lrs, decisions = [], []
    for it in range(1, STEPS + 1):
        settings.train_step(chunks, it)
        if it in SPIKES and tp_rank == 1:
            name, factor = SPIKES[it]
            _shard_grad(handle, name).mul_(factor)
        lrs.append(opt.param_groups[0]["lr"])  # what this step applies
        opt.step()
        scheduler.step(increment=1)
        reporter.record(handle, it)
        d = handle.last_decision
        decisions.append((d.active, d.chosen, d.pinned, d.risk.tolist()))
    reporter.close()
    shapes = {  # the TP1 model's weights: [out, in]
        name[: -len(".weight")]: tuple(p.shape)
        for name, p in full.named_parameters()
        if name.endswith(".weight")
    }
    out = {
        "decisions": decisions,
        "lrs": lrs,
        "sizes": handle.registry.sizes,
        "costs": handle.registry.costs(len(GEMMS)),
        "shapes": shapes,
        "trace": Path(block["log"]["trace"]).read_text() if rank == 0 else None,
    }
    ps.destroy_model_parallel()
    return out


def test_budgets_decide_alike_on_every_rank_and_as_an_offline_controller(tmp_path):
    from gnmr_dist.core import GNMRConfig, GNMRController
    from gnmr_dist.telemetry.trace import read_lrs

    block = {
        "backend": "fp8_emulated",
        "low_cost": {"format": "e3m2"},
        "recovery": {"format": "fp32"},
        "gemms": GEMMS,
        "check_consistency": True,  # a RuntimeError on any rank that decides otherwise
        "log": {"trace": str(tmp_path / "trace.jsonl"), "console": False},
        **POLICY,
    }
    (ranks,) = multiproc.run_jobs([(_budget_worker, 2, (block,))], preload=PRELOAD)
    head, records = _records(ranks[0]["trace"])
    names = head["units"]
    assert ranks[1]["decisions"] == ranks[0]["decisions"]
    # the costs from the TP1 model's shapes: w = 2 x in x out (fprop, dgrad), W = 3 x sum
    shapes = ranks[0]["shapes"]
    sizes = [shapes[n][0] * shapes[n][1] for n in names]
    costs = ([2 * s for s in sizes], 3 * sum(sizes))
    for r in ranks:
        assert list(r["sizes"]) == sizes and tuple(r["costs"]) == (list(costs[0]), costs[1])
    assert head["meta"]["unit_sizes"] == sizes and head["meta"]["gemms"] == GEMMS
    # the offline controller: the recorded norms and learning rates, nothing else of the run
    lrs = read_lrs(tmp_path / "trace.jsonl", records)  # as the optimizer's groups held them
    assert lrs == ranks[0]["lrs"] and lrs[0] == 0.0 and max(lrs) == 1e-3
    pinned = [n.startswith("decoder.layers.3.") for n in names]  # the last of 4 layers
    offline = GNMRController(
        len(names),
        GNMRConfig.from_dict(head["config"]),
        head["eligible"],
        costs=costs[0],
        total_cost=costs[1],
        pinned=pinned,
    )
    chosen_sizes, share_bound = [], False
    for record, lr, mine in zip(records, lrs, ranks[0]["decisions"], strict=True):
        d = offline.step(torch.tensor(record["norms"], dtype=torch.float64), lr=lr)
        assert (d.active, d.chosen, d.pinned, d.risk.tolist()) == mine, record["step"]
        assert list(d.active) == record["active"]
        t = d.telemetry
        chosen_sizes.append(len(d.chosen))
        share_bound |= len(d.chosen) < min(t.budget, t.num_candidates)
        assert sum(costs[0][u] for u in d.chosen) <= 0.1 * costs[1]
    # what the policy did: both budgets bound, the schedule rose, the last layer pinned late
    assert max(chosen_sizes[:4]) <= 1 and max(chosen_sizes) >= 2, chosen_sizes
    assert share_bound
    late = [r for r in records if r["telemetry"].get("num_pinned")]
    assert late and all({i for i, p in enumerate(pinned) if p} <= set(r["active"]) for r in late)
    assert records[0]["telemetry"].get("num_pinned") == 0
    assert int((offline.latches > 0).sum()) >= 1
