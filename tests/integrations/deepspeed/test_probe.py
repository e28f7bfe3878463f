"""``gnmr.probe`` under real DeepSpeed (2 ranks, gloo, CPU): the gaps against an explicit two-pass
reference, probe records on the probe steps only, a run the probe does not change, gnmr-report's
section; and the block's refusals (config, ZeRO-3, fp16, megatron)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from tests.requires import require

require("deepspeed")

from gnmr_dist.integrations.config import GNMRBlock
from tests import multiproc
from tests.integrations.deepspeed import common as dsc

GNMR = {
    "backend": "act_quant",
    "max_active": 2,
    "lock_steps": 2,
    "warmup_steps": 1,
    "alpha": 1.0,
    "beta": 1.0,
}
"""Low thresholds: the decisions (and so the plans the probe steps run) are not all empty."""
PROBE = {"every": 2, "k": 3}
STEPS, GAS = 6, 2
RUNS = {  # name: (ZeRO stage, micro-batches per step, probe)
    "zero0": (0, 1, True),  # torch AdamW is engine.optimizer: the update gap is measured
    "zero1_gas2": (1, GAS, True),  # flat partitions: no update gap; the first micro-batch only
    "zero1_gas2_off": (1, GAS, False),  # the same run without the probe key
}


# =============================================================================== config


@pytest.mark.parametrize(
    "probe, match",
    [
        ({"evry": 2}, r"unknown key gnmr\.probe\.evry; did you mean 'every'"),
        ({"k": 2}, r'gnmr\.probe needs "every": N'),
        ({"every": 0}, r"gnmr\.probe\.every must be an integer >= 1 \(N: probe every N-th"),
        ({"every": "10"}, r"gnmr\.probe\.every must be an integer >= 1"),
        ({"every": 2.0}, r"gnmr\.probe\.every must be an integer >= 1"),
        ({"every": 2, "k": 0}, r"gnmr\.probe\.k must be an integer >= 1"),
        (
            {"every": 2, "k": True},
            r"gnmr\.probe\.k must be an integer >= 1 \(the graded sets' size\), got True",
        ),
        (5, r"gnmr\.probe must be a mapping like \{\"every\": N, \"k\": 3\}"),
    ],
)
def test_probe_block_errors_name_the_key(probe, match):
    with pytest.raises(ValueError, match=match):
        GNMRBlock.from_dict({"backend": "act_quant", "probe": probe})


def test_probe_block_parses_and_is_off_by_default():
    assert GNMRBlock.from_dict({"backend": "int8"}).probe is None
    assert GNMRBlock.from_dict({"backend": "int8", "probe": None}).probe is None
    probe = GNMRBlock.from_dict({"backend": "int8", "probe": {"every": 5}}).probe
    assert (probe.every, probe.k) == (5, 3) and probe.due(10) and not probe.due(11)
    with pytest.raises(ValueError, match=r"gnmr\.probe needs a precision backend.*backend=null"):
        GNMRBlock.from_dict({"backend": None, "probe": {"every": 5}})
    with pytest.raises(
        ValueError,
        match=r"gnmr\.probe\.k \(15\) is larger than the number of "
        r"units \(14\).*at most 14",
    ):
        GNMRBlock.from_dict({"backend": "int8", "probe": {"every": 5, "k": 15}}).probe.check_units(
            14
        )


@pytest.mark.parametrize(
    "stage, extra, match",
    [
        (3, {}, r"gnmr\.probe: ZeRO stage 3 partitions the parameters.*stage 0-2"),
        (1, {"fp16": {"enabled": True}}, r"gnmr\.probe with fp16: .*unscaled loss.*bf16"),
        (0, {"torch_autocast": {"enabled": True, "dtype": "fp16"}}, r"torch_autocast"),
    ],
)
def test_probe_refused_setups_fail_before_any_process_group(stage, extra, match):
    import torch.distributed as dist

    import gnmr_dist.deepspeed as gds

    cfg = dsc.ds_config(stage, gnmr={"backend": "act_quant", "probe": PROBE}, **extra)
    with pytest.raises(NotImplementedError, match=match):
        gds.initialize(model=nn.Linear(4, 4), config=cfg)
    assert not dist.is_initialized()


def test_probe_loss_reads_tensor_attribute_or_mapping():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from gnmr_dist.integrations.deepspeed import probe_loss

    x = torch.tensor(2.0)
    assert probe_loss(x) is x and probe_loss({"loss": x, "logits": x}) is x
    one = torch.tensor([3.0])  # a one-element loss: the same value as a scalar
    assert probe_loss(one).shape == () and probe_loss(one).item() == 3.0
    assert probe_loss(CausalLMOutputWithPast(loss=x)) is x
    for out, said in [
        (torch.ones(2, 3), r"a tensor of shape \(2, 3\), not a loss"),
        (CausalLMOutputWithPast(logits=torch.ones(1)), r"a CausalLMOutputWithPast with keys \["),
        ((x, x), r"a tuple, not a loss"),
        (torch.tensor(3), r"a tensor of shape \(\)"),  # an integer tensor is no loss
    ]:
        with pytest.raises(
            RuntimeError, match=r"gnmr\.probe: the model's forward returned " + said
        ):
            probe_loss(out)
    with pytest.raises(
        RuntimeError, match=r"Return the loss from forward, or drop the gnmr\.probe"
    ):
        probe_loss(None)


def test_megatron_refuses_the_probe_before_patching(tmp_path):
    from gnmr_dist.train.megatron_flags import gnmr_block as _read_block

    path = tmp_path / "gnmr.json"
    path.write_text(json.dumps({"backend": "act_quant", "probe": {"every": 2}}))
    args = argparse.Namespace(gnmr_config=str(path), gnmr_backend=None, gnmr_trace=None)
    said = (
        r"GNMR on Megatron-LM's loop: gnmr\.probe is supported under DeepSpeed .*benchmark "
        r"harness; megatron-core .*drop the gnmr\.probe key"
    )
    with pytest.raises(ValueError, match=said):
        _read_block(args)
    require("megatron.core")
    import megatron_patches

    with pytest.raises(ValueError, match=r"megatron_patches\.enable: gnmr\.probe is supported"):
        megatron_patches.enable(nn.Linear(2, 2), {"backend": "act_quant", "probe": {"every": 2}})
    assert megatron_patches.current() is None


# =============================================================================== real DeepSpeed


def _tokens(step, micro, rank):
    return dsc.batch(10 * step + micro, rank)


def _probe_worker(rank, world, trace_dir):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    out = {}
    for name, (stage, gas, probe) in RUNS.items():
        gnmr = {**GNMR, "log": {"trace": f"{trace_dir}/{name}.jsonl"}}
        if probe:
            gnmr["probe"] = PROBE
        cfg = dsc.ds_config(stage, "fp32", gnmr, gradient_accumulation_steps=gas)
        engine, *_ = gds.initialize(model=dsc.llama(), config=cfg)
        losses, decisions, weights, adam, probes = [], [], {}, {}, {}
        for step in range(1, STEPS + 1):
            if step % PROBE["every"] == 0:  # what the probe of this step sees, for the reference
                weights[step] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
                adam[step] = _adam_state(engine) if stage == 0 else None
            for m in range(gas):
                tokens = _tokens(step, m, rank)
                loss = engine(input_ids=tokens, labels=tokens).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach().clone())
            d = engine.gnmr.last_decision
            decisions.append((d.step, d.active, d.risk.clone()))
            if engine.gnmr.last_probe is not None and engine.gnmr.last_probe.step == step:
                probes[step] = engine.gnmr.last_probe
        out[name] = {
            "losses": losses,
            "decisions": decisions,
            "weights": weights,
            "adam": adam,
            "probes": probes,
            "optimizer": type(engine.optimizer).__name__,
            "names": engine.gnmr.registry.names,
        }
    # (c) a forward that returns no loss (a Hugging Face model without labels=)
    gnmr = {**GNMR, "probe": {"every": 1}}
    engine, *_ = gds.initialize(model=dsc.llama(), config=dsc.ds_config(1, "fp32", gnmr))
    try:
        engine(input_ids=_tokens(1, 0, rank))
    except RuntimeError as err:
        out["no_loss"] = str(err)
    return out


def _adam_state(engine):
    """Name -> (exp_avg_sq, step, beta2, eps) of the torch AdamW that ZeRO 0 steps with."""
    opt = engine.optimizer
    group = {id(p): g for g in opt.param_groups for p in g["params"]}
    return {
        n: (
            opt.state[p]["exp_avg_sq"].clone(),
            float(opt.state[p]["step"]),
            group[id(p)]["betas"][1],
            group[id(p)]["eps"],
        )
        for n, p in engine.module.named_parameters()
        if p in opt.state
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank launch: the three runs and the no-loss forward (see RUNS)."""
    trace_dir = tmp_path_factory.mktemp("probe")
    a, b = multiproc.run(_probe_worker, 2, str(trace_dir))
    return a, b, trace_dir


def reference_gaps(weights, step, adam=None):
    """Independent: one process, plain autograd, the two ranks' first micro-batches of ``step``,
    every unit low-cost, then every unit recovery; the gradient of the mean of the two losses.

    Per unit ``||g_low - g_high||`` and, with ``adam``, the gap over ``sqrt(v_hat) + eps``.
    """
    from gnmr_dist.backends import get_backend
    from gnmr_dist.distributed import UnitRegistry

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting: the same CPU kernels, the same sums
    try:
        model = dsc.llama()
        model.load_state_dict(weights)
        registry = UnitRegistry.from_model(model)
        backend = get_backend("act_quant")
        backend.wrap(registry.local_modules)
        params = dict(model.named_parameters())
        grads = []
        for plan in ((), range(registry.num_units)):
            backend.apply(plan, step)
            per_rank = []
            for r in range(2):
                tokens = _tokens(step, 0, r)
                loss = model(input_ids=tokens, labels=tokens).loss / 2
                per_rank.append(torch.autograd.grad(loss, list(params.values())))
            grads.append({n: a + b for n, a, b in zip(params, *per_rank, strict=True)})
    finally:
        torch.set_num_threads(threads)
    low, high = grads
    out = []
    for scale in ("grad", "update") if adam is not None else ("grad",):
        gaps = []
        for u in dsc.unit_names():
            sq = 0.0
            for n in params:
                if not n.startswith(u + "."):
                    continue
                diff = (low[n] - high[n]).double()
                if scale == "update":
                    v, t, beta2, eps = adam[n]
                    diff = diff / ((v.double() / (1 - beta2**t)).sqrt() + eps)
                sq += float(diff.square().sum())
            gaps.append(sq**0.5)
        out.append(torch.tensor(gaps, dtype=torch.float64))
    return out


@pytest.mark.slow
def test_probe_gaps_equal_an_explicit_two_pass_reference(runs):
    a, b, _ = runs
    for name in ("zero0", "zero1_gas2"):
        assert a[name]["names"] == tuple(dsc.unit_names())
        assert sorted(a[name]["probes"]) == [2, 4, 6]
        for step, p in a[name]["probes"].items():
            q = b[name]["probes"][step]  # every rank holds the same result
            assert torch.equal(p.grad_gap, q.grad_gap), (name, step)
            ref = reference_gaps(a[name]["weights"][step], step, a[name]["adam"][step])
            assert torch.allclose(p.grad_gap, ref[0], rtol=1e-6, atol=0), (name, step)
            assert bool((p.grad_gap > 0).all()) and p.k == 3
            assert bool((p.grad_low_norm > p.grad_gap).all())
            if name == "zero0":
                assert a[name]["optimizer"] == "AdamW"
                assert torch.allclose(p.update_gap, ref[1], rtol=1e-6, atol=0), step
            else:
                assert a[name]["optimizer"] == "DeepSpeedZeroOptimizer"
                assert p.update_gap is None  # flat sharded partitions: no per-parameter state


@pytest.mark.slow
def test_the_probe_changes_nothing_in_the_run(runs):
    for rank in runs[:2]:
        on, off = rank["zero1_gas2"], rank["zero1_gas2_off"]
        assert len(on["losses"]) == STEPS * GAS
        assert all(torch.equal(x, y) for x, y in zip(on["losses"], off["losses"], strict=True))
        for (s, act, risk), (s2, act2, risk2) in zip(
            on["decisions"], off["decisions"], strict=True
        ):
            assert (s, act) == (s2, act2) and torch.equal(risk, risk2)
        assert any(act for _, act, _ in on["decisions"])  # the plans were not all empty
        assert off["probes"] == {}


@pytest.mark.slow
def test_trace_has_probe_records_on_probe_steps_only(runs):
    from gnmr_dist.telemetry import read_trace
    from gnmr_dist.telemetry.selection import top_k
    from gnmr_dist.telemetry.trace import read_probes

    a, _, trace_dir = runs
    for name in RUNS:
        path = trace_dir / f"{name}.jsonl"
        header, _, records = read_trace(path)
        assert len(records) == STEPS
        probed = [r["step"] for r in records if "probe" in r]
        assert probed == ([2, 4, 6] if RUNS[name][2] else [])
        got = {p.step: p for p in read_probes(path, records, len(header.units))}
        decisions = a[name]["decisions"]
        for step, p in got.items():
            want = a[name]["probes"][step]
            assert torch.allclose(p.grad_gap, want.grad_gap, rtol=1e-15, atol=0)
            assert p.sets == want.sets
            assert p.sets["risk_topk"] == top_k(decisions[step - 1][2], 3)
            assert p.sets["decided"] == frozenset(decisions[step - 1][1])
            assert p.sets["active"] == frozenset(decisions[step - 2][1])  # the plan that ran
            assert p.probe_ms > 0 and (p.update_gap is None) == (name != "zero0")
            assert records[step - 1]["probe"]["figures"]["risk_topk"].keys() == {
                "precision_grad",
                "precision_update",
                "share_grad",
                "share_update",
            }
    on, off = (read_trace(trace_dir / f"{n}.jsonl")[1] for n in ("zero1_gas2", "zero1_gas2_off"))
    assert torch.equal(on, off)  # the recorded norms too


@pytest.mark.slow
def test_report_prints_the_selection_quality_of_the_run(runs, capsys):
    require("matplotlib")
    from gnmr_dist.cli.report import main

    _, _, trace_dir = runs
    assert main([str(trace_dir / "zero0.jsonl"), "--out", str(trace_dir / "z0.png")]) == 0
    out = capsys.readouterr().out
    assert "selection quality (3 probe steps, k = 3;" in out
    for label in (
        "risk top-k",
        "active (ran the step)",
        "decided (next step)",
        "first+last layers",
        "random k (expected)",
        "oracle (upper bound)",
    ):
        assert label in out, label
    oracle = next(line for line in out.splitlines() if "oracle" in line).split()
    assert oracle[3:5] == ["1.000", "[3]"] and oracle[7:9] == ["1.000", "[3]"]
    assert main([str(trace_dir / "zero1_gas2.jsonl"), "--out", str(trace_dir / "z1.png")]) == 0
    out = capsys.readouterr().out
    assert "update gap: n/a" in out
    assert next(line for line in out.splitlines() if "risk top-k" in line).endswith("n/a")


@pytest.mark.slow
def test_a_forward_without_a_loss_is_a_named_error(runs):
    for rank in runs[:2]:
        msg = rank["no_loss"]
        assert "gnmr.probe: the model's forward returned a CausalLMOutputWithPast" in msg
        assert "Return the loss from forward, or drop the gnmr.probe key" in msg
