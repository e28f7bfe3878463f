"""gnmr_dist.deepspeed on real DeepSpeed: ZeRO 0-3, fp32/bf16, 2 ranks over gloo, CPU."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.requires import require

require("deepspeed")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

GNMR = dsc.gnmr_block()


def _reference_unit_norms(engine) -> tuple[list[float], float]:
    """The test's own reference: each unit's norm of DeepSpeed's full gradient, gathered for
    the test only (``safe_get_full_grad``), in fp64, and the global norm."""
    from deepspeed.utils import safe_get_full_grad

    full = {n: safe_get_full_grad(p).double() for n, p in engine.module.named_parameters()}
    units = [
        sum(float(full[n].square().sum()) for n in full if n.startswith(u + ".")) ** 0.5
        for u in engine.gnmr.registry.names
    ]
    return units, sum(float(g.square().sum()) for g in full.values()) ** 0.5


def _norms_worker(rank, world, configs):
    import deepspeed

    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    out = {}
    for stage, dtype in configs:
        model = dsc.llama()
        engine, *_ = gds.initialize(model=model, config=dsc.ds_config(stage, dtype, GNMR))
        loss = engine(input_ids=dsc.batch(1, rank), labels=dsc.batch(1, rank)).loss
        engine.backward(loss)
        with multiproc.CollectiveSpy() as spy:
            got = engine.gnmr.runtime.monitor.compute()
        ref, ref_global = _reference_unit_norms(engine)
        engine.step()
        out[(stage, dtype)] = {
            "names": engine.gnmr.registry.names,
            "norms": got.norms,
            "global": got.global_norm,
            "ref": ref,
            "ref_global": ref_global,
            "calls": spy.calls,
            "active": engine.gnmr.last_decision.active,
        }
        deepspeed.comm.barrier()
    return out


def reference_fp32_norms():
    """Independent: one process, the same init and backend, both ranks' batches, averaged loss."""
    from gnmr_dist.backends import get_backend
    from gnmr_dist.distributed import UnitRegistry

    model = dsc.llama()
    backend = get_backend("act_quant")
    backend.wrap(UnitRegistry.from_model(model).local_modules)
    backend.apply((), step=1)
    losses = [model(input_ids=dsc.batch(1, r), labels=dsc.batch(1, r)).loss for r in range(2)]
    (sum(losses) / 2).backward()
    grads = dict(model.named_parameters())
    return {
        u: sum(
            float(p.grad.double().square().sum()) for n, p in grads.items() if n.startswith(u + ".")
        )
        ** 0.5
        for u in dsc.unit_names()
    }


CONFIGS = [(s, d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")]


def test_unit_norms_every_zero_stage_and_dtype():
    results = multiproc.run(_norms_worker, 2, CONFIGS)
    independent = reference_fp32_norms()
    for cfg in CONFIGS:
        a, b = (r[cfg] for r in results)
        assert a["names"] == tuple(dsc.unit_names())
        assert torch.equal(a["norms"], b["norms"]) and a["active"] == b["active"]
        for r in (a, b):
            assert torch.allclose(
                r["norms"], torch.tensor(r["ref"], dtype=torch.float64), rtol=1e-5, atol=0
            ), cfg
            assert r["global"] == pytest.approx(r["ref_global"], rel=1e-5)
            # one all-reduce of U + 1 values over the data-parallel group; nothing gathered
            assert r["calls"] == [("all_reduce", len(dsc.unit_names()) + 1)], cfg
        if cfg[1] == "fp32":  # against a model DeepSpeed never touched
            want = torch.tensor([independent[u] for u in a["names"]], dtype=torch.float64)
            assert torch.allclose(a["norms"], want, rtol=1e-5, atol=0), cfg


OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def _offload_worker(rank, world):

    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    config = dsc.ds_config(
        2, "fp32", GNMR, zero_optimization=OFFLOAD, zero_force_ds_cpu_optimizer=False
    )
    engine, *_ = gds.initialize(model=dsc.llama(), config=config)
    loss = engine(input_ids=dsc.batch(1, rank), labels=dsc.batch(1, rank)).loss
    engine.backward(loss)
    got = engine.gnmr.runtime.monitor.compute()
    ref, _ = _reference_unit_norms(engine)
    engine.step()
    return {
        "offload": bool(engine.optimizer.cpu_offload),
        "norms": got.norms.tolist(),
        "ref": ref,
        "decisions": int(engine.gnmr.controller.step_count),
    }


def test_zero_offload_stage2_norms_equal_the_full_gradients():
    """ZeRO-Offload (optimizer on CPU): GNMR reads the fp32 partition DeepSpeed offloads into."""
    for r in multiproc.run(_offload_worker, 2):
        assert r["offload"] and r["decisions"] == 1
        assert r["norms"] == pytest.approx(r["ref"], rel=1e-5) and min(r["ref"]) > 0


GAS = 2
"""Micro-batches per optimizer step in the error-sum test (DeepSpeed divides each loss by it)."""


def _errors_worker(rank, world):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    cfg = dsc.ds_config(1, "fp32", {**GNMR, "gamma": 0.5}, gradient_accumulation_steps=GAS)
    engine, *_ = gds.initialize(model=dsc.llama(), config=cfg)
    for m in range(GAS):
        tokens = dsc.batch(1 + m, rank)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        if m == GAS - 1:  # the boundary: what the hook reduces, read once more under a spy
            with multiproc.CollectiveSpy() as spy:
                got = engine.gnmr.runtime.monitor.compute()
        engine.step()
    d = engine.gnmr.last_decision
    names = engine.gnmr.registry.names
    return {
        "names": names,
        "norms": got.norms,
        "sums": got.error_sums,
        "calls": spy.calls,
        "global": got.global_norm,
        "error": d.error,
        "active": d.active,
    }


def reference_error_sums() -> tuple[torch.Tensor, torch.Tensor, float]:
    """One process, no DeepSpeed: both ranks' micro-batches, the loss averaged over all four."""
    from gnmr_dist.backends import get_backend
    from gnmr_dist.distributed import GradNormMonitor, UnitRegistry

    model = dsc.llama()
    registry = UnitRegistry.from_model(model)
    backend = get_backend("act_quant")
    backend.wrap(registry.local_modules)
    backend.track_errors(registry.num_units)
    backend.apply((), step=1)
    batches = [dsc.batch(1 + m, r) for r in range(2) for m in range(GAS)]
    losses = [model(input_ids=b, labels=b).loss for b in batches]
    (sum(losses) / len(losses)).backward()
    got = GradNormMonitor(registry, error_fn=backend.error_sums).compute()
    return got.norms, got.error_sums, got.global_norm


def test_error_sums_are_summed_over_dp_ranks_and_scaled_by_one_over_dp():
    """ZeRO-1, 2 ranks x 2 micro-batches: the reduced B(u) equals one process's B on all four
    micro-batches with the averaged loss; e = B / G reaches the controller; one all-reduce."""
    a, b = multiproc.run(_errors_worker, 2)
    ref_norms, ref_sums, ref_global = reference_error_sums()
    u = len(dsc.unit_names())
    assert a["names"] == tuple(dsc.unit_names())
    for r in (a, b):
        assert r["calls"] == [("all_reduce", 2 * u + 1)]  # norms and errors in one collective
        assert torch.allclose(r["sums"], ref_sums, rtol=1e-6, atol=0)
        assert torch.allclose(r["norms"], ref_norms, rtol=1e-5, atol=0)
        assert torch.allclose(r["error"], r["sums"] / r["global"], rtol=1e-12, atol=0)
        assert torch.allclose(r["error"], ref_sums / ref_global, rtol=1e-5, atol=0)
    assert torch.equal(a["sums"], b["sums"]) and a["active"] == b["active"]
    assert bool((ref_sums > 0).all())


def _spike_worker(rank, world, spike_step, steps):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    engine, *_ = gds.initialize(model=dsc.llama(), config=dsc.ds_config(2, "fp32", GNMR))
    target = engine.module.model.layers[1].mlp.up_proj.weight
    reports, decisions, after = [], [], []
    for step in range(1, steps + 1):
        handle = target.register_hook(lambda g: g * 50) if step == spike_step else None
        loss = engine(input_ids=dsc.batch(step, rank), labels=dsc.batch(step, rank)).loss
        reports.append(engine.gnmr.backend.report())  # what this step's forward ran
        engine.backward(loss)
        engine.step()
        if handle is not None:
            handle.remove()
        decisions.append(engine.gnmr.last_decision.active)
        after.append((engine.gnmr.last_report, dict(engine.gnmr.backend.report().ran)))
    return engine.gnmr.registry.names, decisions, reports, after


def test_spike_selected_at_k_and_recovered_at_k_plus_one():
    k = 8
    results = multiproc.run(_spike_worker, 2, k, k + 2)
    names, decisions, reports, after = results[0]
    assert results[1][1] == decisions
    unit = names.index("model.layers.1.mlp.up_proj")
    assert unit in decisions[k - 1] and all(unit not in d for d in decisions[: k - 1])
    assert unit in reports[k].recovered  # step k + 1 ran it on the recovery path
    assert unit not in reports[k - 1].recovered  # step k itself still ran low-cost
    assert reports[k].step == k + 1
    # read after engine.step(): last_report is the step just taken, backend.report() the next
    # step's, empty until its forward (issue 33, item 6)
    assert [a[0] for a in after] == reports and all(a[1] == {} for a in after)


def _train(engine, rank, first, last, spike_at=25):
    out = []
    target = engine.module.model.layers[0].self_attn.o_proj.weight
    for step in range(first, last + 1):
        handle = target.register_hook(lambda g: g * 30) if step == spike_at else None
        loss = engine(input_ids=dsc.batch(step, rank), labels=dsc.batch(step, rank)).loss
        engine.backward(loss)
        engine.step()
        if handle is not None:
            handle.remove()
        d = engine.gnmr.last_decision
        out.append((d.step, d.active, d.risk.clone()))
    return out


def _resume_worker(rank, world, ckpt, phase, trace):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    gnmr = {**GNMR, "log": {"trace": trace}}
    cfg = dsc.ds_config(
        1, "fp32", gnmr, csv_monitor={"enabled": True, "output_path": ckpt, "job_name": phase}
    )
    engine, *_ = gds.initialize(model=dsc.llama(), config=cfg)
    if phase == "full":
        first = _train(engine, rank, 1, 20)
        engine.save_checkpoint(ckpt)
        return first + _train(engine, rank, 21, 40)
    engine.load_checkpoint(ckpt)
    assert engine.gnmr.controller.step_count == 20
    return _train(engine, rank, 21, 40)


def test_save_at_20_resume_in_fresh_processes_equals_uninterrupted(tmp_path):
    trace = str(tmp_path / "trace.jsonl")
    full = multiproc.run(_resume_worker, 2, str(tmp_path / "ckpt"), "full", trace)
    resumed = multiproc.run(_resume_worker, 2, str(tmp_path / "ckpt"), "resumed", trace)
    for rank in range(2):
        for (s, a, r), (s2, a2, r2) in zip(full[rank][20:], resumed[rank], strict=True):
            assert (s, a) == (s2, a2) and torch.equal(r, r2)
    assert any(a for _, a, _ in full[0][20:])  # something was selected after the cut
    from gnmr_dist.telemetry.replay import Recording, replay

    # the resumed run dropped the interrupted run's records after step 20 and rewrote 21..40
    rec = Recording.read(trace)
    assert list(rec.header.units) == dsc.unit_names() and len(rec.records) == 40
    summary = replay(rec, compare=True)
    assert summary.matches_recorded == 40  # the trace replays to the same decisions
    csv = tmp_path / "ckpt" / "full" / "gnmr_num_active.csv"
    assert csv.is_file() and len(csv.read_text().splitlines()) == 41  # header + 40 steps
    # on DeepSpeed's own axis (its Train/Samples/* events): samples, 2 ranks x 2 per step
    axis = [int(float(x.split(",")[0])) for x in csv.read_text().splitlines()[1:]]
    assert axis == [4 * s for s in range(1, 41)]


def _flip(data: bytes, byte: int, bit: int) -> bytes:
    out = bytearray(data)
    out[byte] ^= 1 << bit
    return bytes(out)


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _bad_state_worker(rank, world, ckpt, stride):
    """Train 8 steps (a spike at 8, so locks and a plan are held) and save; then load that
    checkpoint back through ``engine.load_checkpoint`` with its GNMR state truncated, with one
    bit flipped, hand-edited and re-sealed, removed, and intact, under both block choices.
    Rank 0 then flips one bit of every ``stride``-th byte of the state in turn (bit ``byte %
    8``) and loads each through the DeepSpeed path's own reader and restore: none may load a
    state that differs from the saved one."""
    import dataclasses

    import gnmr_dist.deepspeed as gds
    from gnmr_dist.integrations.state_file import read_state, restore_or_refuse
    from gnmr_dist.state import seal

    dsc.no_shm_build()
    engine, *_ = gds.initialize(model=dsc.llama(), config=dsc.ds_config(1, "fp32", GNMR))
    _train(engine, rank, 1, 8, spike_at=8)
    engine.save_checkpoint(ckpt)
    path = Path(ckpt) / "global_step8" / "gnmr_state.pt"
    pristine, want = path.read_bytes(), engine.gnmr.state_dict()
    assert want["plan_active"] or bool((want["controller"]["lock"] > 0).any())
    dist.barrier()  # every rank holds the saved bytes before rank 0 rewrites the file below
    edited = torch.load(io.BytesIO(pristine), weights_only=True)
    edited["plan_active"] = [99]
    buf = io.BytesIO()
    torch.save(seal(edited), buf)
    cases = {
        "truncated": pristine[:100],
        "flipped": None,
        "resealed": buf.getvalue(),
        "missing": b"",
        "intact": pristine,
    }
    base, msgs = engine.gnmr.block, {}
    for case, data in cases.items():
        for choice in ("error", "fresh"):
            if rank == 0:
                if case == "missing":
                    path.unlink(missing_ok=True)
                else:
                    raw = torch.load(io.BytesIO(pristine), weights_only=True)
                    raw["controller"]["window_buffer"].view(-1)[3] += 2.0**-40  # one low bit
                    flipped = io.BytesIO()
                    torch.save(raw, flipped)  # the old checksum, one altered value
                    path.write_bytes(data if data is not None else flipped.getvalue())
            dist.barrier()
            engine.gnmr.block = dataclasses.replace(
                base, on_missing_state=choice, on_corrupt_state=choice
            )
            try:
                engine.load_checkpoint(ckpt)
                msgs[case, choice] = f"step {engine.gnmr.controller.step_count}"
            except (FileNotFoundError, ValueError) as err:
                msgs[case, choice] = f"{type(err).__name__}: {err}"
            dist.barrier()
    engine.gnmr.block = base
    sweep = {"bytes": len(pristine), "flips": 0, "refused": 0, "same": 0, "different": 0}
    if rank == 0:
        for byte in range(0, len(pristine), stride):
            sweep["flips"] += 1
            path.write_bytes(_flip(pristine, byte, byte % 8))
            try:
                restore_or_refuse(base, str(path), read_state(path), engine.gnmr)
            except ValueError:
                sweep["refused"] += 1
                continue
            same = _same_state(engine.gnmr.state_dict(), want)
            sweep["same" if same else "different"] += 1
    dist.barrier()
    return msgs, sweep


BITFLIP_STRIDE = int(os.environ.get("GNMR_BITFLIP_STRIDE", "4"))
"""Every 4th byte in the suite (about 2,000 loads, 12 s); ``GNMR_BITFLIP_STRIDE=1``: every byte."""


def test_a_bad_state_is_refused_by_name_and_a_bit_flip_never_loads_silently(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    msgs, sweep = multiproc.run(_bad_state_worker, 2, ckpt, BITFLIP_STRIDE)[0]
    fix = 'set "on_corrupt_state": "fresh"'
    assert msgs["truncated", "error"].startswith("ValueError: gnmr: cannot restore the GNMR")
    assert fix in msgs["truncated", "error"]
    flipped = msgs["flipped", "error"]
    assert "does not match its checksum: controller.window_buffer was altered" in flipped
    assert fix in flipped
    resealed = msgs["resealed", "error"]
    assert "plan_active=[99] holds ids outside [0, 14)" in resealed and fix in resealed
    missing = msgs["missing", "error"]
    assert missing.startswith("FileNotFoundError") and 'set "on_missing_state": "fresh"' in missing
    for case in ("truncated", "flipped", "resealed", "missing"):
        assert msgs[case, "fresh"] == "step 0", case  # started fresh on purpose
    assert msgs["intact", "error"] == msgs["intact", "fresh"] == "step 8"
    # one bit flipped in turn: refused, or loaded to exactly the saved state (a flip in the
    # zip's padding or its unchecked CRC fields changes nothing that is read)
    print(f"bit-flip sweep (stride {BITFLIP_STRIDE}): {sweep}")
    assert sweep["different"] == 0, sweep
    assert sweep["refused"] + sweep["same"] == sweep["flips"] >= sweep["bytes"] // BITFLIP_STRIDE
    assert sweep["refused"] > sweep["same"], sweep


def _fp16_worker(rank, world, stage):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    out = {}
    for dtype in ("fp32", "fp16"):
        extra = {"fp16": {"enabled": True, "initial_scale_power": 8}} if dtype == "fp16" else {}
        engine, *_ = gds.initialize(
            model=dsc.llama(), config=dsc.ds_config(stage, "fp32", {"backend": None}, **extra)
        )
        loss = engine(input_ids=dsc.batch(1, rank), labels=dsc.batch(1, rank)).loss
        engine.backward(loss)
        engine.step()
        out[dtype] = (engine.gnmr.runtime.last_norms.norms, engine.optimizer.__class__.__name__)
    return out


def _cpu_fp16_supported() -> bool:
    """DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels (AVX512-FP16 or
    AMX-FP16 CPUs); elsewhere ``deepspeed.initialize`` refuses it, as on these test machines."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_loss_scale_is_divided_out(stage):
    if not _cpu_fp16_supported():
        pytest.skip("this CPU has no oneDNN fp16 kernels: DeepSpeed refuses fp16 here")
    out = multiproc.run(_fp16_worker, 1, stage)[0]
    fp32, fp16 = out["fp32"][0], out["fp16"][0]
    # a 2^8 loss scale left in would make every norm 256x; fp16 rounding stays within 1%
    assert torch.allclose(fp16, fp32, rtol=1e-2, atol=0), (stage, (fp16 / fp32).tolist())


def _args_worker(rank, world, cfg_path):
    import argparse

    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    args = argparse.Namespace(deepspeed_config=cfg_path, local_rank=rank)
    engine, *_ = gds.initialize(args=args, model=dsc.llama())
    return engine.gnmr.block.policy.max_active, args.deepspeed_config


def test_launcher_style_args_deepspeed_config(tmp_path):
    cfg = dsc.ds_config(1, gnmr={"backend": "act_quant", "max_active": 3})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert multiproc.run(_args_worker, 2, str(path)) == [(3, str(path))] * 2  # args untouched
