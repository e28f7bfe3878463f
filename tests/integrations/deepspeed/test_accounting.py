"""Issue 34 under real DeepSpeed (CPU, gloo): unit costs, budget schedules and the compute-share
budget on 2 and 4 ranks, and the accounting of a NaN gradient through a checkpoint and resume.

**The NaN design.** DeepSpeed 0.19's ZeRO 1-2 optimizer skips a step whose gradient norm is not
finite, in fp32 and bf16 as in fp16 (``DeepSpeedZeroOptimizer.step``: ``overflow`` from the
global norm, all-reduced over the data-parallel group; see test_skipped_step), so a NaN that
one rank injects into one unit's gradient never reaches the weights: the run goes on, and GNMR,
whose norms were reduced before the skip, counts the skipped step's non-finite unit
(``GNMRRuntime.skip``). That is the case tested here, on ZeRO-2 fp32 with 2 ranks; the
non-finite norm a decided step feeds the controller (a framework that does not skip) is tested
on the runtime in tests/distributed/test_accounting.py.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from tests.requires import require

require("deepspeed")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

LAYERS = 2
POISONED = "model.layers.1.mlp.down_proj"
NAN_AT, SAVE_AT, LAST = 5, 7, 10
"""Rank 1's NaN gradient at step 5 (DeepSpeed skips it), a checkpoint after step 7, steps to 10;
step numbers are the batches fed, so the skipped batch is retried by none (the next is 6)."""


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _listen() -> _Lines:
    handler = _Lines()
    log = logging.getLogger("gnmr_dist")
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    return handler


def _train(engine, rank, first, last, hooks=None):
    for step in range(first, last + 1):
        handles = [h(engine, rank) for h in (hooks or {}).get(step, [])]
        tokens = dsc.batch(step, rank)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        for h in handles:
            if h is not None:
                h.remove()


def _poison(engine, rank):
    if rank != 1:
        return None
    weight = engine.module.model.layers[1].mlp.down_proj.weight
    return weight.register_hook(lambda g: g * math.nan)


SPIKES = {
    4: [("o_proj", 0, 30.0)],
    6: [("up_proj", 1, 20.0)],
    9: [("q_proj", 1, 25.0)],
    11: [("gate_proj", 0, 40.0), ("v_proj", 0, 15.0)],
}
"""Gradient factors by step: (projection, layer, factor)."""


def _spikes(step):
    """The hooks of step ``step``'s spikes (for :func:`_train`)."""

    def hook(proj, layer, factor):
        def register(engine, rank):
            block = engine.module.model.layers[layer]
            attn = proj in ("q_proj", "k_proj", "v_proj", "o_proj")
            module = getattr(block.self_attn if attn else block.mlp, proj)
            return module.weight.register_hook(lambda g: g * factor)

        return register

    return [hook(*spike) for spike in SPIKES.get(step, [])]


def _nan_worker(rank, world, ckpt, trace, phase):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    lines = _listen()
    block = dsc.gnmr_block(log={"trace": trace, "console": False})
    monitor = {"enabled": True, "output_path": ckpt, "job_name": phase}
    cfg = dsc.ds_config(2, "fp32", block, csv_monitor=monitor)
    engine, *_ = gds.initialize(model=dsc.llama(layers=LAYERS), config=cfg)
    gnmr = engine.gnmr
    if phase == "whole":
        _train(engine, rank, 1, SAVE_AT, {4: _spikes(4), NAN_AT: [_poison]})
        engine.save_checkpoint(ckpt)
        at_save = gnmr.summary().as_dict(gnmr.registry.names)
        _train(engine, rank, SAVE_AT + 1, LAST)
    else:
        engine.load_checkpoint(ckpt)
        at_save = gnmr.summary().as_dict(gnmr.registry.names)
        _train(engine, rank, SAVE_AT + 1, LAST)
    return {
        "lines": lines.lines,
        "at_save": at_save,
        "end": gnmr.summary().as_dict(gnmr.registry.names),
        "summary_lines": gnmr.summary_lines(),
        "skipped": engine.skipped_steps,
        "controller": gnmr.controller.step_count,
    }


def test_a_nan_in_one_ranks_gradient_is_named_alike_counted_and_survives_a_resume(tmp_path):
    from gnmr_dist.telemetry import read_trace
    from gnmr_dist.telemetry.trace import read_accounting

    ckpt, trace = str(tmp_path / "ckpt"), str(tmp_path / "trace.jsonl")
    whole = multiproc.run(_nan_worker, 2, ckpt, trace, "whole")
    names = dsc.unit_names(LAYERS)
    unit = names.index(POISONED)
    first = {"step": NAN_AT, "unit": unit, "name": POISONED, "skipped": True}
    line = (
        f"gnmr: first non-finite gradient norm of the run at step {NAN_AT}: unit {unit} "
        f"{POISONED} (nan; 1 of {len(names)} units non-finite), a step the framework skipped"
    )
    for res in whole:
        # the premise: DeepSpeed skipped the step on every rank, GNMR took no decision for it
        assert res["skipped"] == 1 and res["controller"] == LAST - 1
        named = [x for x in res["lines"] if "first non-finite" in x]
        assert named == [line]  # one line, the same on both ranks (rank 1 alone saw the NaN)
        for summary in (res["at_save"], res["end"]):
            assert summary["nonfinite_unit_steps"] == summary["skipped_nonfinite_unit_steps"] == 1
            assert summary["first_nonfinite"] == first
            assert summary["per_unit"][POISONED]["nonfinite"] == 1
        assert res["end"]["steps"] == LAST - 1
        assert any(
            s.startswith("gnmr: non-finite gradient norms in 1 unit-steps (1 on steps")
            and s.endswith(f"unit {unit} {POISONED}, a step the framework skipped")
            for s in res["summary_lines"]
        )
    assert whole[0]["end"] == whole[1]["end"]
    # something ran recovered, and the counts are the controller's
    assert whole[0]["end"]["recovered_unit_steps"] > 0

    resumed = multiproc.run(_nan_worker, 2, ckpt, trace, "resumed")
    for before, after in zip(whole, resumed, strict=True):
        assert after["at_save"] == before["at_save"]  # restored from the checkpoint
        assert after["end"] == before["end"]  # and continued, not reset
        assert not [x for x in after["lines"] if "first non-finite" in x]  # named once per run

    header, norms, records = read_trace(trace)
    assert len(records) == LAST - 1 and bool(torch.isfinite(norms).all())
    retried = records[NAN_AT - 1]  # the record of decision 5 (batch 6), after the skip
    assert retried["skipped_nonfinite"] == [unit] and retried["first_nonfinite"] == first
    counted = read_accounting(header, records)
    assert counted["nonfinite"] == [int(i == unit) for i in range(len(names))]
    assert counted["recovered"] == [
        whole[0]["end"]["per_unit"].get(n, {}).get("recovered", 0) for n in names
    ]
    # DeepSpeed's monitor (csv_monitor): the per-unit entry only for the unit that had a count
    runs = tmp_path / "ckpt" / "whole"
    bad = runs / f"gnmr_accounting_nonfinite_{POISONED}.csv"
    assert bad.is_file() and bad.read_text().splitlines()[1].split(",")[1] == "1.0"
    others = [n for n in names if n != POISONED]
    assert not any((runs / f"gnmr_accounting_nonfinite_{n}.csv").exists() for n in others)
    total = (runs / "gnmr_accounting_nonfinite_unit_steps.csv").read_text().splitlines()
    assert [float(x.split(",")[1]) for x in total[1:]] == [0.0] * 4 + [1.0] * (LAST - 1 - 4)


# ------------------------------------------------------------------ schedules and shares

LR_TABLE = [1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.2, 0.1, 0.1]
"""The learning rate's factor at step t is LR_TABLE[t - 1] (a LambdaLR stepped by DeepSpeed)."""

POLICY = {
    "warmup_steps": 2,
    "lock_steps": 2,
    "alpha": 1.3,
    "beta": 1.6,
    "max_active": {"schedule": "step", "start": 1, "end": 3, "clock": "lr_decay", "to": 0.3},
    "max_share": {"schedule": "linear", "start": 0.05, "end": 0.1, "steps": 10},
    "latch": {"lr_decay": 0.3},
    "pinned": {"units": ["*.layers.1.self_attn.k_proj"], "from": {"lr_decay": 0.5}},
    "gemms": ["dgrad", "wgrad"],
}


def _schedule_worker(rank, world, trace):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    block = dsc.gnmr_block(**POLICY, log={"trace": trace, "console": False})

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: LR_TABLE[min(s, 13)])

    engine, *_ = gds.initialize(
        model=dsc.llama(), config=dsc.ds_config(2, "fp32", block), lr_scheduler=scheduler
    )
    decisions = []
    for step in range(1, len(LR_TABLE) + 1):
        _train(engine, rank, step, step, {step: _spikes(step)})
        d = engine.gnmr.last_decision
        decisions.append(
            (d.step, d.active, d.chosen, d.pinned, d.candidates, d.telemetry.as_dict())
        )
    return decisions, engine.gnmr.registry.sizes


@pytest.mark.parametrize("world", [2, 4])
def test_budget_schedules_and_share_decide_alike_on_every_rank_and_offline(tmp_path, world):
    from gnmr_dist.core import GNMRConfig, GNMRController
    from gnmr_dist.telemetry import read_trace
    from gnmr_dist.telemetry.trace import read_lrs

    trace = str(tmp_path / "trace.jsonl")
    results = multiproc.run(_schedule_worker, world, trace)  # check_consistency on every step
    decisions, sizes = results[0]
    assert all(r == results[0] for r in results)  # every rank, every decision and count
    header, norms, records = read_trace(trace)
    # the learning rate the optimizer applied at step t: the factor of step t, not t + 1
    assert read_lrs(trace, records) == pytest.approx([1e-3 * f for f in LR_TABLE])
    # the header carries what an offline controller needs: the sizes and the GEMM subset
    assert header.meta["unit_sizes"] == list(sizes) and header.meta["gemms"] == ["dgrad", "wgrad"]
    cfg = GNMRConfig.from_dict({k: v for k, v in POLICY.items() if k != "gemms"})
    assert header.config == cfg
    offline = GNMRController(
        len(header.units),
        cfg,
        list(header.eligible),
        costs=[2 * s for s in sizes],
        total_cost=3 * sum(sizes),
        pinned=cfg.pinned.mask(header.units),
    )
    for (*decided, tele), row, rec in zip(decisions, norms, records, strict=True):
        d = offline.step(row, lr=rec["lr"])
        assert (d.step, d.active, d.chosen, d.pinned, d.candidates) == tuple(decided)
        assert d.telemetry.as_dict() == tele == rec["telemetry"]
    # not vacuous: the budget moved, the share cap and the pinned unit and a latch took part
    budgets = [t["budget"] for *_, t in decisions]
    assert budgets[0] == 1 and budgets[-1] == 3
    assert any(t["num_latched"] for *_, t in decisions)
    pinned = [p for _, _, _, p, _, _ in decisions]
    assert any(pinned) and not any(pinned[:6])  # from d_t >= 0.5 (step 8) on
    # the share cap skipped a candidate although the count budget had room
    assert any(
        len(chosen) < t["budget"] and len(cands) > len(chosen)
        for _, _, chosen, _, cands, t in decisions
    )


# ------------------------------------------------------------------ costs


def test_unit_costs_of_the_small_llama_are_its_in_times_out():
    from gnmr_dist.distributed import UnitRegistry

    reg = UnitRegistry.from_model(dsc.llama())
    hidden, ffn, kv = 32, 64, 2 * (32 // 4)  # 4 heads of 8, 2 key-value heads
    per_layer = {
        "q_proj": hidden * hidden,
        "k_proj": hidden * kv,
        "v_proj": hidden * kv,
        "o_proj": hidden * hidden,
        "gate_proj": hidden * ffn,
        "up_proj": hidden * ffn,
        "down_proj": ffn * hidden,
    }
    assert list(reg.names) == dsc.unit_names()
    assert list(reg.sizes) == [per_layer[n.rsplit(".", 1)[1]] for n in reg.names]
    w, total = reg.costs(2)
    assert w == [2 * s for s in reg.sizes] and total == 3 * 2 * sum(per_layer.values())
    mlp, key = reg.index["model.layers.0.mlp.up_proj"], reg.index["model.layers.0.self_attn.k_proj"]
    assert reg.sizes[mlp] / reg.sizes[key] == ffn / kv == 4.0


@pytest.mark.parametrize(
    "dims, ratio",
    [
        # Llama-2 7B: 32 heads and 32 key-value heads of 128; the MLP is 11008 wide
        ((4096, 11008, 32, 32), 11008 / 4096),
        # Llama-3 8B: grouped-query attention, 8 key-value heads of 128; MLP 14336
        ((4096, 14336, 32, 8), 14336 / 1024),
    ],
)
def test_an_mlp_projection_against_a_key_projection(dims, ratio):
    """docs/algorithm.md#compute-share's comparison on the real shapes (meta device: nothing
    allocated): an MLP projection over a key projection is ``ffn / (kv_heads x head_dim)``,
    2.69 for a Llama whose keys have every head (Llama-2 7B), 14 under grouped-query
    attention (Llama-3 8B)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gnmr_dist.distributed import UnitRegistry

    hidden, ffn, heads, kv_heads = dims
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=2,
        vocab_size=128,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    reg = UnitRegistry.from_model(model)
    up, key = reg.index["model.layers.1.mlp.up_proj"], reg.index["model.layers.1.self_attn.k_proj"]
    assert reg.sizes[up] == hidden * ffn and reg.sizes[key] == hidden * kv_heads * hidden // heads
    assert reg.sizes[up] / reg.sizes[key] == pytest.approx(ratio)
