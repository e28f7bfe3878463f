"""gnmr_dist.integrations.megatron_pretrain: layouts agree, resume is exact, user errors exit 2.

Every run trains the same tiny GPT (4 layers, hidden 64, 4 heads, seq 16, vocab 128) for 30
iterations on synthetic tokens with a global batch of 8, Adam, clipping at 1.0, GNMR on the
``act_quant`` backend (8-bit saved activations, full precision on recovery), so the controller's
decisions change the numerics of later iterations. Two gradient spikes are injected with the
entry point's own ``--inject-grad-spike`` (layer 2 x100 at iteration 15, layer 0 x30 at 22): the
gradients of one global layer are scaled after megatron's data-parallel reduction, in every
layout alike, which makes the decisions non-trivial (units of the spiked layer go to recovery).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from gnmr_dist.integrations.megatron_pretrain import TRACKER_FILE, parse_args
from tests import multiproc

pytestmark = pytest.mark.slow

ITERS = 30
GNMR = {
    "backend": "act_quant",
    "low_cost": {"bits": 8, "group_size": 32},
    "recovery": {"bits": 32},
    "max_active": 2, "lock_steps": 4, "window": 8, "warmup_steps": 5,
    "check_consistency": True,  # every decision is also hash-compared across all ranks
}  # fmt: skip
MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 128 "
    "--micro-batch-size 2 --global-batch-size 8 --optimizer adam --lr 1e-3 --clip-grad 1.0 "
    f"--seed 1234 --train-iters {ITERS} --log-interval 100 --data synthetic "
    "--inject-grad-spike 15:2 --inject-grad-spike 22:0:30"
).split()


def _worker(rank, world, argvs):
    from gnmr_dist.integrations.megatron_pretrain import pretrain

    return [pretrain(parse_args(argv)) for argv in argvs]


def _layout(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


@pytest.fixture(scope="module")
def gnmr_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gnmr": GNMR}))  # DeepSpeed-style file
    return str(path)


@pytest.fixture(scope="module")
def reference(gnmr_config):
    """The TP1/PP1 run (one process)."""
    [[run]] = multiproc.run(_worker, 1, [[*MODEL, "--gnmr-config", gnmr_config]])
    return run


def _assert_same_decisions(runs, reference):
    """Every rank's decisions equal, bit for bit, and equal to the reference's (same actives).

    Across layouts the risk vectors differ by reduction-order noise only (measured: relative
    <= 2.3e-4); a decision could then legitimately differ only where a risk is within that noise
    of the threshold 1 or of the next-ranked unit, which the failure message reports.
    """
    ref = {it: k for k, it in enumerate(reference["iteration"])}
    for r in runs:
        assert r["units"] == reference["units"]  # unit ids do not depend on the layout
        for k, it in enumerate(r["iteration"]):
            risk, ref_risk = r["risk"][k], reference["risk"][ref[it]]
            assert r["step"][k] == it
            assert torch.equal(risk, runs[0]["risk"][k])  # bitwise the same on every rank
            noise = float((risk - ref_risk).abs().max())
            margin = float((ref_risk - 1).abs().min())
            assert r["active"][k] == reference["active"][ref[it]], (
                f"rank {r['rank']} iteration {it}: risk noise {noise:.2e}, "
                f"closest risk to the threshold {margin:.2e}"
            )
            torch.testing.assert_close(risk, ref_risk, rtol=1e-3, atol=1e-6)


def _assert_same_losses(runs, reference, rtol):
    ref = dict(zip(reference["iteration"], reference["loss"], strict=True))
    for r in runs:
        for it, loss in zip(r["iteration"], r["loss"], strict=True):
            assert loss == pytest.approx(ref[it], rel=rtol), f"rank {r['rank']} iter {it}"


def test_decisions_are_nontrivial(reference):
    active, names = reference["active"], reference["units"]
    assert active[:14] == [()] * 14  # nothing before the first spike
    assert len(active[14]) == 2  # iteration 15: the budget, spent on the spiked layer
    assert all(names[u].startswith("decoder.layers.2.") for u in active[14])
    assert active[15:18] == [active[14]] * 3  # held by the lock (lock_steps 4)
    assert all(names[u].startswith("decoder.layers.0.") for u in active[21])  # iteration 22
    assert reference["grad_norm"][14] > 10 * reference["grad_norm"][13]


@pytest.mark.parametrize("world, tp, pp", [(4, 2, 2), (4, 2, 1)], ids=["tp2-pp2", "tp2-dp2"])
def test_layouts_match_tp1(reference, gnmr_config, world, tp, pp):
    argv = [*MODEL, *_layout(tp, pp), "--gnmr-config", gnmr_config]
    runs = [r for [r] in multiproc.run(_worker, world, [argv])]
    for r in runs:
        assert r["iteration"] == list(range(1, ITERS + 1))
        assert r["loss"] == runs[0]["loss"]  # every rank reports the same global loss
    _assert_same_losses(runs, reference, rtol=1e-4)
    _assert_same_decisions(runs, reference)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, gnmr_config):
    """TP2: 30 iterations saving at 15 (and 30), then a fresh process group loading 15 -> 30."""
    root = tmp_path_factory.mktemp("resume")
    ckpt, trace = root / "ckpt", root / "trace.jsonl"
    argv = [*MODEL, *_layout(2, 1), "--gnmr-config", gnmr_config, "--trace", str(trace)]
    save = [*argv, "--save", str(ckpt), "--save-interval", "15"]
    full = [r for [r] in multiproc.run(_worker, 2, [save])]
    shutil.copytree(ckpt, root / "at15")
    (root / "at15" / TRACKER_FILE).write_text("15")
    again = [r for [r] in multiproc.run(_worker, 2, [[*argv, "--load", str(root / "at15")]])]
    return {"full": full, "resumed": again, "root": root, "trace": trace}


def test_resume_reproduces_the_uninterrupted_run(resumed, reference):
    tail = slice(15, ITERS)
    for full, again in zip(resumed["full"], resumed["resumed"], strict=True):
        assert again["start_iteration"] == 15
        assert again["iteration"] == list(range(16, ITERS + 1))
        assert again["active"] == full["active"][tail]  # exactly the same decisions
        for a, b in zip(again["risk"], full["risk"][tail], strict=True):
            assert torch.equal(a, b)
        assert again["loss"] == full["loss"][tail]  # and bitwise the same training
        assert again["grad_norm"] == full["grad_norm"][tail]
    # the uninterrupted TP2 run is a third layout that agrees with TP1
    _assert_same_losses(resumed["full"], reference, rtol=1e-4)
    _assert_same_decisions(resumed["full"], reference)


def test_resume_at_another_layout(resumed, reference, gnmr_config):
    """The TP2 checkpoint of iteration 15 continues as a TP1 run: it tracks the TP1 reference."""
    argv = [*MODEL, "--gnmr-config", gnmr_config, "--load", str(resumed["root"] / "at15")]
    [[run]] = multiproc.run(_worker, 1, [argv])
    assert run["iteration"] == list(range(16, ITERS + 1))
    _assert_same_losses([run], reference, rtol=1e-4)
    _assert_same_decisions([run], reference)


def test_resumed_trace_holds_every_step_once(resumed):
    lines = resumed["trace"].read_text().splitlines()
    records = [json.loads(x) for x in lines[1:]]
    assert json.loads(lines[0])["format"] == "gnmr-trace"
    assert [r["step"] for r in records] == list(range(1, ITERS + 1))
    assert [tuple(r["active"]) for r in records] == resumed["full"][0]["active"]


def test_checkpoint_contents(resumed):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = resumed["root"] / "ckpt"
    sharded = FileSystemReader(str(ckpt / "iter_0000015")).read_metadata().state_dict_metadata
    # global shapes: the TP2 shards ([64, 64] each) were saved as one [128, 64] tensor
    assert sharded["output_layer.weight"].size == torch.Size([128, 64])
    assert sharded["optimizer.state.exp_avg.output_layer.weight"].size == torch.Size([128, 64])
    assert sharded["optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight"].size == (
        torch.Size([4, 256, 64])  # layers stacked by global layer number
    )
    assert (ckpt / TRACKER_FILE).read_text() == str(ITERS)
    common = torch.load(ckpt / "iter_0000015" / "common.pt", weights_only=True)
    assert common["iteration"] == 15
    assert common["gnmr"]["controller"]["step"] == 15
    assert common["gnmr"]["plan_active"] == list(resumed["full"][0]["active"][14])
    assert common["gnmr"]["unit_names"] == resumed["full"][0]["units"]
    assert common["args"]["tensor_model_parallel_size"] == 2


def test_missing_gnmr_state_is_refused_before_building(resumed, gnmr_config, monkeypatch, capsys):
    ckpt = resumed["root"] / "no_gnmr"
    shutil.copytree(resumed["root"] / "at15", ckpt)
    common = torch.load(ckpt / "iter_0000015" / "common.pt", weights_only=True)
    torch.save({**common, "gnmr": None}, ckpt / "iter_0000015" / "common.pt")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*MODEL, *_layout(2, 1), "--load", str(ckpt)]
    with pytest.raises(SystemExit) as err:
        parse_args([*argv, "--gnmr-config", gnmr_config])
    assert err.value.code == 2
    assert_matches(capsys.readouterr().err, r"has no GNMR state.*on_missing_state")
    fresh = Path(resumed["root"], "fresh.json")
    fresh.write_text(json.dumps({**GNMR, "on_missing_state": "fresh"}))
    assert parse_args([*argv, "--gnmr-config", str(fresh)]).load_dir.endswith("iter_0000015")


# ------------------------------------------------------------------------------ user errors


@pytest.mark.parametrize(
    "world, extra, message",
    [
        (3, _layout(2, 1),
         r"world size \(3\) must be divisible by tensor x pipeline model parallel size "
         r"\(2 x 1 = 2\)"),
        (4, ["--tensor-model-parallel-size", "2", "--global-batch-size", "6"],
         r"global batch size \(6\) must be divisible by micro batch size x data-parallel size "
         r"\(2 x 2 = 4\)"),
        (1, ["--backend", "act_quantt"], r"unknown backend 'act_quantt'; did you mean 'act_quant'"),
        (2, ["--num-layers", "3", *_layout(1, 2)], r"--num-layers \(3\) must be divisible"),
        (1, ["--inject-grad-spike", "5:9"], r"0 <= LAYER < 4"),
    ],
    ids=["world-not-divisible", "global-batch-not-divisible", "unknown-backend", "layers-pp",
         "spike-layer"],
)  # fmt: skip
def test_user_errors_exit_2_with_the_message(monkeypatch, capsys, world, extra, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as err:
        parse_args([*MODEL, *extra])
    assert err.value.code == 2
    assert_matches(capsys.readouterr().err, message)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", r"not valid JSON"),
        ('{"gnmr": {"max_activ": 2}}', r"max_activ.*max_active"),
        ('{"backend": "int8", "recovery": {"bitz": 8}}', r"bitz"),
    ],
    ids=["bad-json", "unknown-key", "bad-backend-options"],
)
def test_bad_gnmr_config_exits_2(tmp_path, monkeypatch, capsys, content, message):
    path = tmp_path / "gnmr.json"
    path.write_text(content)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as err:
        parse_args([*MODEL, "--gnmr-config", str(path)])
    assert err.value.code == 2
    assert_matches(capsys.readouterr().err, message)


def test_console_entry_point_exits_2_before_any_process_group():
    """Under torchrun's environment but without MASTER_ADDR: only validation can run."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}
    env.pop("MASTER_ADDR", None)
    cmd = [sys.executable, "-m", "gnmr_dist.integrations.megatron_pretrain", *MODEL,
           *_layout(2, 1)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert "world size (3) must be divisible by tensor x pipeline" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_text_data_is_byte_level_and_deterministic(tmp_path, monkeypatch):
    from gnmr_dist.integrations.megatron_pretrain import _Batches

    (tmp_path / "b.txt").write_bytes(bytes(range(40, 80)))
    (tmp_path / "a.txt").write_bytes(b"hello world, " * 3)
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse_args([*MODEL, "--vocab-size", "256", "--data", str(tmp_path / "*.txt")])
    stream = list(b"hello world, " * 3 + b"\n" + bytes(range(40, 80)))  # sorted, newline-joined
    batches = _Batches(args, torch.device("cpu"))
    first = batches.micro_batch(1, 0)
    assert first["tokens"].tolist() == [stream[0:16], stream[16:32]]
    assert first["labels"].tolist() == [stream[1:17], stream[17:33]]
    count = (len(stream) - 1) // 16  # samples of 17 tokens at stride 16, then wrap around
    second = batches.micro_batch(2, 1)  # samples 8 * 1 + 2 * 1 = 10, 11 (mod count)
    assert second["tokens"][0].tolist() == stream[(10 % count) * 16 :][:16]
    assert torch.equal(batches.micro_batch(2, 1)["tokens"], second["tokens"])
    with pytest.raises(SystemExit):
        parse_args([*MODEL, "--data", str(tmp_path / "*.txt")])  # vocab 128 < 256


def assert_matches(text, pattern):
    import re

    assert re.search(pattern, text, re.S), text


def test_indexed_dataset_is_read_as_token_ids(tmp_path, monkeypatch, capsys):
    """``--data PREFIX`` reads a megatron-core indexed dataset: its documents in order."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from gnmr_dist.integrations.megatron_pretrain import _Batches

    docs = [list(range(5, 45)), list(range(100, 127))]
    builder = IndexedDatasetBuilder(str(tmp_path / "c.bin"), dtype=np.int32)
    for doc in docs:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(str(tmp_path / "c.idx"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse_args([*MODEL, "--data", str(tmp_path / "c")])
    stream = docs[0] + docs[1]
    first = _Batches(args, torch.device("cpu")).micro_batch(1, 0)
    assert first["tokens"].tolist() == [stream[0:16], stream[16:32]]
    assert first["labels"].tolist() == [stream[1:17], stream[17:33]]
    with pytest.raises(ValueError, match="holds token id 126, but --vocab-size is 100"):
        _Batches(parse_args([*MODEL, "--vocab-size", "100", "--data", str(tmp_path / "c")]),
                 torch.device("cpu"))  # fmt: skip
