"""``gnmr-megatron-pretrain`` on Megatron-LM's own loop: 2 CPU processes under torchrun, gloo.

A LLaMA-shaped Megatron-LM argument set (SwiGLU, RMSNorm, RoPE, GQA, untied output, no biases,
bf16, TP2 + sequence parallel, the distributed optimizer, warm-up + cosine LR, ``--data-path``
on the embedded corpus written as an indexed dataset by ``gnmr_dist.data``, TensorBoard,
``--save``) runs on megatron-core 0.17.1 (``megatron.training`` ships from 0.17). TP2 on 2
processes leaves DP1: the distributed optimizer then holds each parameter whole on its one DP
rank (its sharding over DP is covered by tests/integrations/megatron/test_gnmr_settings.py).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from tests.cli.test_policy_matrix import BASE
from tests.integrations.megatron.settings import training_env
from tests.multiproc import torchrun

ROOT = Path(__file__).resolve().parents[3]
ITERS = 20
PROGRAM = "gnmr_dist.cli.megatron_pretrain"

LLAMA = f"""
--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention
--num-query-groups 2 --ffn-hidden-size 128 --swiglu --normalization RMSNorm
--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear
--seq-length 64 --max-position-embeddings 64
--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 4
--lr-decay-style cosine --lr-decay-iters {ITERS} --weight-decay 0.1 --clip-grad 1.0
--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --bf16
--tokenizer-type NullTokenizer --vocab-size 256 --split 90,5,5 --log-interval 4 --eval-iters 0
--seed 1234
""".split()
"""A LLaMA set with megatron's default dropout (0.1) and without --eval-interval (the program
supplies Megatron-LM's customary 1000)."""

GNMR = {
    **BASE,  # the policy matrix's act_quant block (4-bit to 8-bit, per operator)
    "lock_steps": 3,
    "window": 6,
    "warmup_steps": 4,
    "log": {"console": 4},
    # at tensor parallel 1 the untied embedding and output layer (256 x 64 each) of this tiny
    # model carry 99% of the late steps' squared norm: real, not an attribution miss
    "attribution": {"max_rest_share": 0.999},
}
SPIKE = ["--gnmr-inject-grad-spike", "9:1:100"]


def _env() -> dict[str, str]:
    return training_env(CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1")


def _torchrun(args: list[str], cwd: Path, fails: bool = False) -> str:
    cmd = [*torchrun(2), "-m", PROGRAM, *args]
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    if fails:
        assert done.returncode != 0
        return done.stdout + done.stderr
    if done.returncode != 0:
        raise AssertionError(
            f"exit {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        )
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the indexed dataset (the embedded corpus through ``gnmr_dist.data``,
    the DeepSpeed program's token stream: 45 files, so that the 5% splits hold documents;
    megatron's epoch count never ends on an empty split) and the GNMR block."""
    work = tmp_path_factory.mktemp("megatron_lm")
    script = (
        "from gnmr_dist.data import write_indexed_dataset\n"
        f"write_indexed_dataset('embedded', {str(work / 'text_document')!r}, max_bytes=10**6)\n"
    )
    subprocess.run([sys.executable, "-c", script], env=_env(), check=True, capture_output=True)
    (work / "gnmr.json").write_text(json.dumps({"gnmr": GNMR}))
    return work


def _args(work: Path, name: str, *extra: str) -> list[str]:
    llama = list(LLAMA)
    if "--tensor-model-parallel-size" in extra:  # the extra layout replaces the set's
        at = llama.index("--tensor-model-parallel-size")
        del llama[at : at + 2]
        llama.remove("--sequence-parallel")
    return [
        *llama,
        "--data-path",
        str(work / "text_document"),
        "--tensorboard-dir",
        str(work / name / "tb"),
        *extra,
    ]


def _trace(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "step" in r]


def _losses(log: str) -> dict[int, str]:
    """``{iteration: lm loss as printed}`` from megatron's own iteration log."""
    out = {}
    for line in log.splitlines():
        if " iteration " in line and "lm loss:" in line:
            iteration = int(line.split(" iteration ")[1].split("/")[0])
            out[iteration] = line.split("lm loss:")[1].split("|")[0].strip()
    return out


TP1 = ["--tensor-model-parallel-size", "1"]
"""The resume runs: tensor parallel 1 (data parallel 2), where megatron's default dropout (0.1)
draws from the default CUDA stream, not the tracker's forked ones (tensor / sequence parallel
regions): the stream a data loader's draw after ``--load`` shifted on CPU before the CUDA stream
was kept apart (``gnmr_dist.testing.megatron_cpu.training``)."""


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, str]:
    """The uninterrupted run (saving at half way), and a run resumed from that checkpoint."""
    gnmr = ["--gnmr-config", str(work / "gnmr.json"), *SPIKE, *TP1]
    iters = ["--train-iters", str(ITERS), "--log-interval", "1"]  # every iteration's loss
    half = str(ITERS // 2)
    full = _torchrun(
        _args(
            work,
            "full",
            *iters,
            *gnmr,
            *("--gnmr-trace", str(work / "full" / "trace.jsonl")),
            *("--save", str(work / "ckpt"), "--save-interval", half),
        ),
        work,
    )
    resumed = _torchrun(
        _args(
            work,
            "resumed",
            *iters,
            *gnmr,
            *("--gnmr-trace", str(work / "resumed" / "trace.jsonl")),
            *("--load", str(work / "ckpt"), "--ckpt-step", half),  # the full run's half way
            *("--save", str(work / "ckpt_resumed"), "--save-interval", "100"),
        ),
        work,
    )
    return {"full": full, "resumed": resumed}


def test_llama_set_runs_and_gnmr_acts_on_the_spike(runs, work):
    rows = _trace(work / "full" / "trace.jsonl")
    assert [r["step"] for r in rows] == list(range(1, ITERS + 1))
    assert set(range(4, ITERS + 1, 4)) <= set(_losses(runs["full"]))
    active_after = {tuple(r["active"]) for r in rows if r["step"] >= 9}
    assert any(active_after), "the x100 spike in layer 1 never put a unit on the recovery path"
    names = json.loads((work / "full" / "trace.jsonl").read_text().splitlines()[0])["units"]
    spiked = {i for i, n in enumerate(names) if "layers.1." in n}
    assert set(rows[8]["active"]) <= spiked and rows[8]["active"], rows[8]


def test_resume_gives_the_uninterrupted_decisions(runs, work):
    half = ITERS // 2
    full = _trace(work / "full" / "trace.jsonl")
    resumed = _trace(work / "resumed" / "trace.jsonl")
    assert [r["step"] for r in resumed] == list(range(half + 1, ITERS + 1))  # each step once
    for a, b in zip(full[half:], resumed, strict=True):
        assert a["active"] == b["active"], (a["step"], a["active"], b["active"])
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-5, abs=1e-9)
    assert f"gnmr: state restored at controller step {half} from --load" in runs["resumed"]
    full_losses, after = _losses(runs["full"]), _losses(runs["resumed"])
    # megatron logs a run's first iteration without resetting its interval sums (training_log:
    # "On first iteration, log stats but don't reset accumulators"), so the resumed run's second
    # figure is the mean of its first two iterations; every other figure is the full run's
    first, second = half + 1, half + 2
    assert sorted(after) == list(range(first, ITERS + 1)) and after[first] == full_losses[first]
    both = (float(full_losses[first]) + float(full_losses[second])) / 2
    assert float(after[second]) == pytest.approx(both, rel=2e-6)
    assert all(after[i] == full_losses[i] for i in range(second + 1, ITERS + 1))


def test_gnmr_scalars_reach_megatrons_tensorboard(runs, work):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "full" / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"gnmr/num_active", "gnmr/num_exceed", "gnmr/global_grad_norm", "lm loss"} <= set(tags)
    assert [e.step for e in events.Scalars("gnmr/num_active")] == list(range(1, ITERS + 1))
    assert any(t.startswith("gnmr/risk/decoder.layers.1.") for t in tags)


def test_null_backend_observes_only(work):
    """GNMR off and GNMR with backend none: the same loss curve, digit for digit. Then a
    checkpoint without GNMR state, loaded with GNMR on, is refused with the fix named."""
    short = ["--train-iters", "8", "--log-interval", "1"]
    save = ["--save", str(work / "ckpt_off"), "--save-interval", "8"]
    off = _torchrun(_args(work, "off", *short, *save), work)
    gnmr = ["--gnmr-config", str(work / "gnmr.json"), "--gnmr-backend", "none"]
    observe = _torchrun(_args(work, "observe", *short, *gnmr), work)
    assert list(_losses(off)) == list(range(1, 9))
    assert _losses(off) == _losses(observe)
    assert "\ngnmr step 8 | exceed " in observe and "gnmr step" not in off
    load = ["--load", str(work / "ckpt_off"), "--train-iters", "8"]
    refused = _torchrun(_args(work, "refused", *load, *gnmr), work, fails=True)
    assert "(iteration 8) has no GNMR state. Resuming without it" in refused
    assert 'set "on_missing_state": "fresh"' in refused


def test_bad_block_exits_2_before_any_process_group(tmp_path):
    """(The block reader's other refusals, e.g. gnmr.probe, are tested in-process:
    tests/integrations/deepspeed/test_probe.py, tests/launch/test_preflight.py.)"""
    path, said = tmp_path / "gnmr.json", "gnmr.max_activ; did you mean 'max_active'?"
    path.write_text(json.dumps({"gnmr": {"max_activ": 2}}))
    cmd = [sys.executable, "-m", PROGRAM, *LLAMA, "--mock-data", "--gnmr-config", str(path)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and said in done.stderr, done.stderr[-3000:]
    assert "initializing torch distributed" not in done.stdout


def test_fail_at_must_be_an_iteration():
    from gnmr_dist.testing.drills import check_fail_at as _fail_at

    assert _fail_at(None) is None and _fail_at(5) == 5
    with pytest.raises(ValueError, match="--gnmr-fail-at must be an iteration >= 1, got 0"):
        _fail_at(0)


OWN = shlex.split("""
--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128
--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4
--lr 1e-3 --lr-warmup-iters 2 --lr-decay-style constant --clip-grad 1.0 --seed 7
--tokenizer-type NullTokenizer --vocab-size 128 --log-interval 4 --eval-iters 0 --train-iters 12
--gnmr-inject-grad-spike 6:1:100
""")
"""The own script's set: LayerNorm + GELU (the script's spec), no data path (its own data)."""


def _own(
    work: Path, name: str, *extra: str, config: str = "gnmr.json", base: list[str] = OWN
) -> str:
    """``own_pretrain.py`` (next to this file) under torchrun (2 ranks) with ``base`` (default
    ``OWN``) and GNMR from ``work / config``."""
    script = Path(__file__).with_name("own_pretrain.py")
    trace = ["--gnmr-trace", str(work / name / "trace.jsonl")]
    args = [*base, "--gnmr-config", str(work / config), *trace, *extra]
    cmd = torchrun(2)
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), _env().get("PYTHONPATH", "")])}
    done = subprocess.run(
        [*cmd, str(script), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout + done.stderr


def test_a_pretrain_script_of_its_own_gets_gnmr_from_two_lines(work):
    """Decisions on every iteration, the spike's layer selected, the "gnmr" checkpoint entry
    restored by a resume that makes the uninterrupted run's decisions."""
    _own(work, "own_full", "--save", str(work / "own_ckpt"), "--save-interval", "6")
    from_6 = ["--load", str(work / "own_ckpt"), "--ckpt-step", "6"]  # the full run's iteration 6
    second = _own(
        work, "own_resumed", *from_6, "--save", str(work / "own_2"), "--save-interval", "100"
    )
    full, resumed = (
        _trace(work / "own_full" / "trace.jsonl"),
        _trace(work / "own_resumed" / "trace.jsonl"),
    )
    assert [r["step"] for r in full] == list(range(1, 13))
    names = json.loads((work / "own_full" / "trace.jsonl").read_text().splitlines()[0])["units"]
    assert any("layers.1." in names[u] for u in full[5]["active"]), full[5]
    assert "gnmr: state restored at controller step 6 from --load" in second
    assert [r["step"] for r in resumed] == list(range(7, 13))
    for a, b in zip(full[6:], resumed, strict=True):
        assert a["active"] == b["active"] and a["norms"] == pytest.approx(b["norms"], rel=1e-5)


def test_an_own_script_at_tp2_on_cpu_needs_no_cuda_device_max_connections(work):
    """Issue 33, item 5: at TP 2 Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1, which
    nothing set on a CPU host; ``attach_from_argv`` sets it (and says so) when it is unset."""
    script = Path(__file__).with_name("own_pretrain.py")
    iters = OWN.index("--train-iters") + 1
    args = [*OWN[:iters], "4", *OWN[iters + 1 :], "--tensor-model-parallel-size", "2"]
    args += ["--gnmr-config", str(work / "gnmr.json"), "--gnmr-trace", str(work / "tp2.jsonl")]
    env = {k: v for k, v in _env().items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [*torchrun(2), str(script), *args],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "no CUDA: set CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM requires it" in out
    assert [r["step"] for r in _trace(work / "tp2.jsonl")] == [1, 2, 3, 4]


def test_help_lists_the_gnmr_flags_from_the_venv_as_it_is():
    """``gnmr-megatron-pretrain --help`` in ``make``'s venv, no extra environment: megatron's
    own flags and GNMR's (megatron's first parse, ``ft_integration.setup``, has no
    ``extra_args_provider``: the program prints the whole text itself)."""
    script = Path(sys.executable).with_name("gnmr-megatron-pretrain")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(script), "--help"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for flag in ("--tensor-model-parallel-size", "--gnmr-config", "--gnmr-inject-grad-spike"):
        assert flag in done.stdout, flag


FPROP = {
    "backend": "fp8_emulated",
    "low_cost": {"format": "e3m2"},
    "recovery": {"format": "fp32"},
    "gemms": ["fprop"],
    "max_active": 1,
    "lock_steps": 2,
    "warmup_steps": 3,
    "alpha": 1.5,
    "latch": {"step": 1},
    "pinned": {"units": {"last_layers": 1}},
    "log": {"console": 1},
    "attribution": {"max_rest_share": 0.999},
}
"""Issue 34: the forward GEMM only, the last layer pinned for the whole run, a latch from the
start (a unit selected while exceeding stays recovered), one unit of budget."""

FPROP_ARGS = [
    *OWN[: OWN.index("--train-iters")],
    *("--train-iters", "6", "--log-interval", "1", "--tensor-model-parallel-size", "2"),
    *("--hidden-dropout", "0", "--attention-dropout", "0", "--gnmr-inject-grad-spike", "4:0:100"),
]
"""``OWN`` at TP2 for 6 iterations, a spike in layer 0 at iteration 4, no dropout (so the resumed
run draws nothing the interrupted one did not)."""

SIZES = {
    "linear_qkv": 64 * 192,
    "linear_proj": 64 * 64,
    "linear_fc1": 64 * 128,
    "linear_fc2": 128 * 64,
}
"""``in x out`` of each projection of ``OWN``'s model (hidden 64, 4 heads, FFN 128)."""


def _logged_lrs(log: str) -> dict[int, float]:
    """``{iteration: learning rate}`` as megatron's iteration log prints it."""
    out = {}
    for line in log.splitlines():
        if " iteration " in line and "learning rate:" in line:
            iteration = int(line.split(" iteration ")[1].split("/")[0])
            out[iteration] = float(line.split("learning rate:")[1].split("|")[0])
    return out


def test_fprop_only_with_pinned_last_layer_and_a_latch_on_megatrons_loop(work):
    """Issue 34 on Megatron-LM's loop at TP2: the pinned last layer on the recovery path from
    the first plan on, the spiked layer-0 unit latched, the accounting's summary at the end with
    forward GEMMs only, the learning rate each step applied in the trace, and a resume from
    megatron's checkpoint that ends with the uninterrupted run's counts."""
    (work / "fprop.json").write_text(json.dumps({"gnmr": FPROP}))
    run = partial(_own, work, config="fprop.json", base=FPROP_ARGS)
    full = run("fprop_full", "--save", str(work / "fprop_ckpt"), "--save-interval", "3")
    from_3 = ["--load", str(work / "fprop_ckpt"), "--ckpt-step", "3"]
    resumed = run("fprop_resumed", *from_3, "--tensorboard-dir", str(work / "fprop_tb"))
    head = json.loads((work / "fprop_full" / "trace.jsonl").read_text().splitlines()[0])
    rows = _trace(work / "fprop_full" / "trace.jsonl")
    names = head["units"]
    last = {i for i, n in enumerate(names) if n.startswith("decoder.layers.1.")}
    assert [r["step"] for r in rows] == list(range(1, 7)) and len(last) == 4
    assert all(last <= set(r["active"]) and r["telemetry"]["num_pinned"] == 4 for r in rows)
    spiked = [set(r["active"]) - last for r in rows]
    assert spiked[:3] == [set()] * 3 and len(spiked[3]) == 1 and spiked[3] == spiked[5]
    assert rows[5]["telemetry"]["num_latched"] == 1
    # the learning rate each step applied: megatron's log prints the next step's
    lrs = [r["lr"] for r in rows]
    assert lrs[:3] == [0.0, 5e-4, 1e-3] and set(lrs[2:]) == {1e-3}
    logged = _logged_lrs(full)
    assert [logged[i] for i in range(1, 6)] == pytest.approx(lrs[1:], rel=1e-6)
    # the summary: forward GEMMs only, shares from the shapes of OWN's model
    sizes = [SIZES[n.rsplit(".", 1)[1]] for n in names]
    assert head["meta"]["unit_sizes"] == sizes and head["meta"]["gemms"] == ["fprop"]
    ran = [u for r in rows[:-1] for u in r["active"]]  # R_t runs at step t + 1
    flops = 100 * sum(sizes[u] for u in ran) / (3 * sum(sizes) * 6)
    summary = [
        f"gnmr: 6 steps, 8 units: recovered {len(ran)} of 48 unit-steps "
        f"({100 * len(ran) / 48:.3f}%), {flops:.3f}% of the units' linear FLOPs (fprop "
        f"{len(ran)}, dgrad 0, wgrad 0 unit-steps)",
        "gnmr: no non-finite gradient norm in the run",
    ]
    for log in (full, resumed):  # once, on rank 0
        assert [line.count(w) for w in summary for line in log.splitlines() if w in line] == [1, 1]
    # the resume from megatron's checkpoint: the same decisions, the counts continued
    assert "gnmr: state restored at controller step 3 from --load" in resumed
    again = _trace(work / "fprop_resumed" / "trace.jsonl")
    assert [r["active"] for r in again] == [r["active"] for r in rows[3:]]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "fprop_tb"))
    events.Reload()
    fprop = events.Scalars("gnmr/accounting/recovered_steps/fprop")
    assert [(e.step, e.value) for e in fprop][-1] == (6, len(ran))
    assert [e.value for e in events.Scalars("gnmr/accounting/recovered_steps/wgrad")] == [0] * 3
