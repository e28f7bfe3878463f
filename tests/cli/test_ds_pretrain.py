"""The `make demo` job end to end: two processes under torchrun and the run folder it leaves."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gnmr_dist.deepspeed import load_ds_config
from gnmr_dist.telemetry import read_trace
from tests.multiproc import torchrun

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _torchrun() -> list[str]:
    """``torchrun`` of the DeepSpeed program on 2 local processes."""
    return [*torchrun(2), "-m", "gnmr_dist.cli.ds_pretrain"]


def _tiny_llama(vocab: int, hidden: int, layers: int, heads: int, positions: int = 2048):
    """A small ``LlamaForCausalLM`` built from its config (nothing downloaded), MLP 2 x hidden."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers}
    config = LlamaConfig(
        vocab_size=vocab, num_attention_heads=heads, max_position_embeddings=positions, **shape
    )
    return LlamaForCausalLM(config)


def _demo(run: Path, steps: int, *extra: str, program: list[str] | None = None):
    """The demo config on a tiny model (1 layer x 32, 7 units) for ``steps`` steps."""
    cmd = [
        *(program or _torchrun()),
        *("--config", str(ROOT / "configs" / "demo_deepspeed.hjson"), "--run-dir", str(run)),
        *shlex.split(f"--steps {steps} --layers 1 --hidden 32 --seq-len 32 --max-bytes 200000"),
        "--no-progress",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _console_lines(out: subprocess.CompletedProcess) -> list[str]:
    """GNMR's console lines, wherever the program's logging sent them."""
    text = out.stdout + out.stderr
    return [line for line in text.splitlines() if line.startswith("gnmr step ")]


def test_demo_job_writes_trace_report_summary_and_checkpoint(tmp_path):
    """300 steps of the demo: the run folder, and a console that stays quiet (at most ~15
    lines of GNMR's in a 300-step run: one every ``log.console`` = 25 steps)."""
    run = tmp_path / "run"
    out = _demo(run, 300)
    assert "gnmr-ds-pretrain: 300 steps on 2 processes" in out.stdout
    lines = _console_lines(out)
    assert [int(line.split()[2]) for line in lines] == list(range(25, 301, 25))
    summary = json.loads((run / "summary.json").read_text())
    _, norms, records = read_trace(run / "trace.jsonl")
    assert summary["steps"] == 300 and summary["decisions"] == 300 and norms.shape == (300, 7)
    assert all("loss" in r["extra"] for r in records)  # the job notes its loss per step
    assert summary["last_loss"] < summary["first_loss"]
    assert (run / "report.png").stat().st_size > 20_000
    assert (run / "checkpoint" / "latest").read_text().strip() == "global_step300"
    assert (run / "checkpoint" / "global_step300" / "gnmr_state.pt").is_file()


USER_PROGRAM = """
import logging, sys
logging.getLogger("gnmr_dist.console").setLevel(logging.WARNING)  # the user's choice
from gnmr_dist.train.ds_pretrain import main
sys.exit(main())
"""


@pytest.mark.parametrize("how", ["log.console false", "user's setLevel(WARNING)"])
def test_the_console_line_is_the_users_to_switch_off(tmp_path, how):
    """Off by the config's switch, or by the user's level on its logger: no line at all, and
    the rest of the run's output as usual."""
    if how == "log.console false":
        cfg = load_ds_config(ROOT / "configs" / "demo_deepspeed.hjson")
        cfg["gnmr"]["log"] = {"console": False}
        (tmp_path / "quiet.json").write_text(json.dumps(cfg))
        out = _demo(tmp_path / "run", 50, "--config", str(tmp_path / "quiet.json"))
    else:
        (tmp_path / "user.py").write_text(USER_PROGRAM)
        program = [*_torchrun()[:-2], str(tmp_path / "user.py")]
        out = _demo(tmp_path / "run", 50, program=program)
    assert _console_lines(out) == []
    assert "gnmr-ds-pretrain: 50 steps on 2 processes" in out.stdout


def test_missing_config_is_reported(tmp_path, capsys):
    from gnmr_dist.train.ds_pretrain import main

    with pytest.raises(SystemExit) as stop:
        main(["--config", str(tmp_path / "nope.json")])
    assert stop.value.code == 2
    assert "nope.json does not exist (see configs/" in capsys.readouterr().err


def test_lora_int8_fine_tuning_from_a_local_model(tmp_path):
    """The paper's third setting at toy scale: a saved model, peft LoRA adapters, the int8
    backend; only the adapters train and the run exports them."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = _tiny_llama(vocab=258, hidden=32, layers=2, heads=4, positions=32)
    base.save_pretrained(tmp_path / "base")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "gnmr": {"backend": "int8", "max_active": 2, "warmup_steps": 2, "alpha": 1.1},
        "pretrain": {
            "lora_rank": 4,
            "steps": 8,
            "seq_len": 32,
            "max_bytes": 200_000,
            "no_progress": True,
        },
    }
    (tmp_path / "lora.json").write_text(json.dumps(config))
    run = tmp_path / "run"
    cmd = [
        *_torchrun(),
        *("--config", str(tmp_path / "lora.json"), "--run-dir", str(run)),
        *("--init-from", str(tmp_path / "base")),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    header, norms, _ = read_trace(run / "trace.jsonl")
    assert norms.shape == (8, 14) and header.meta["backend"] == "int8"
    assert all(".lora_" not in u and u.startswith("model.layers.") for u in header.units)
    assert (run / "hf_model" / "adapter_config.json").is_file()  # the adapter, not the base
    from peft import PeftModel

    tuned = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(tmp_path / "base"), run / "hf_model"
    )
    for name, p in base.named_parameters():  # frozen base weights are untouched
        assert torch.equal(tuned.get_parameter(f"base_model.model.{name}"), p), name
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 14 and all(p.abs().sum() > 0 for p in lora_b)  # B starts at 0


def test_lora_needs_a_model_to_start_from(tmp_path, capsys):
    from gnmr_dist.train.ds_pretrain import main

    (tmp_path / "c.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "c.json"), "--lora-rank", "4"])
    assert "give --init-from DIR" in capsys.readouterr().err


def test_next_token_loss_is_next_token_cross_entropy():
    """Against an explicit reference: position t predicts token t + 1 (HF's own ``labels=``
    shift must not be applied on top of pre-shifted targets)."""

    from gnmr_dist.train.ds_pretrain import next_token_loss

    torch.manual_seed(0)
    model = _tiny_llama(vocab=50, hidden=16, layers=1, heads=2)
    tokens = torch.randint(0, 50, (3, 9))
    logp = torch.log_softmax(model(input_ids=tokens[:, :-1]).logits.double(), dim=-1)
    want = -sum(logp[b, t, tokens[b, t + 1]] for b in range(3) for t in range(8)) / 24
    assert torch.allclose(next_token_loss(model, tokens).double(), want, rtol=1e-5)
    assert torch.allclose(model(input_ids=tokens, labels=tokens).loss.double(), want, rtol=1e-5)


def test_the_probe_is_refused_before_anything_starts(tmp_path, capsys):
    from gnmr_dist.train.ds_pretrain import main

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gnmr": {"backend": "act_quant", "probe": {"every": 2}},
    }
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "c.json")])
    assert "gnmr.probe: gnmr-ds-pretrain computes its next-token loss" in capsys.readouterr().err


def test_fail_at_kills_the_last_rank_on_the_first_attempt_only():
    """``--fail-at STEP`` (the restart drill): SIGKILL on the first attempt, nothing on a
    restart (``TORCHELASTIC_RESTART_COUNT`` > 0) or on another rank or step."""
    import os
    import signal
    import subprocess

    code = (
        "from gnmr_dist.train.ds_pretrain import _maybe_fail\n"
        "_maybe_fail(3, 2, 1, 2); _maybe_fail(3, 3, 0, 2); _maybe_fail(3, 3, 1, 2)\n"
        "print('survived')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert first.returncode == -signal.SIGKILL and "survived" not in first.stdout
    assert "--fail-at 3: rank 1 sends itself SIGKILL" in first.stderr
    env["TORCHELASTIC_RESTART_COUNT"] = "1"
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert again.returncode == 0 and again.stdout.strip() == "survived"


def test_a_config_without_a_block_is_refused_unless_told_to_observe(tmp_path, capsys):
    """Issue 33, item 1: gnmr-ds-pretrain observed silently with the default policy when the
    config had no "gnmr" block; now it says so in one line and needs --observe."""
    from gnmr_dist.train.ds_pretrain import parse_args

    path = tmp_path / "ds.json"
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    path.write_text(json.dumps(config))
    argv = ["--config", str(path), "--run-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=1)
    assert 'ds.json: no "gnmr" block, so this run has no GNMR settings' in capsys.readouterr().err
    observed = parse_args([*argv, "--observe"], world_size=1)
    assert observed.gnmr_block.enabled and observed.gnmr_block.backend is None
    path.write_text(json.dumps({**config, "gnmr": {"backend": "act_quant"}}))
    with pytest.raises(SystemExit):
        parse_args([*argv, "--observe"], world_size=1)
    assert '--observe is for a config without a "gnmr" block' in capsys.readouterr().err


def test_the_summary_does_not_print_rates_for_a_run_inside_its_warm_up():
    """Issue 33, item 6: "0.000% ... after the 20 warm-up steps" when every step was warm-up."""
    from gnmr_dist.train.ds_pretrain import rates_line

    run = {"warmup_steps": 20, "skipped_steps": 0, "exceedance_rate": 0.0, "recovery_rate": 0.0}
    assert rates_line({**run, "steps": 20}) == (
        "  no exceedance or recovery figures: all 20 steps were within the 20 warm-up steps "
        "(gnmr.warmup_steps), when GNMR only learns the norms; 0 skipped steps"
    )
    assert rates_line({**run, "steps": 21, "exceedance_rate": 0.05}) == (
        "  exceedances 5.000% and recovery 0.000% of the eligible unit-steps after the 20 "
        "warm-up steps; 0 skipped steps"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the note is for hosts without CUDA")
def test_a_fused_adam_build_on_a_cpu_is_announced_with_the_way_around_it(tmp_path, caplog):
    """Issue 33, item 6: the shipped NVFP4 config spent 2 minutes building FusedAdam, silently."""
    from gnmr_dist.train.ds_pretrain import parse_args

    config = load_ds_config(ROOT / "configs" / "deepspeed" / "llama2_130m_nvfp4.hjson")
    del config["optimizer"]["params"]["torch_adam"]  # issue 41: the shipped config sets it now
    assert config["optimizer"]["type"] == "AdamW"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    parse_args(["--config", str(path), "--run-dir", str(tmp_path / "run")], world_size=1)
    assert "on this CPU host DeepSpeed compiles its fused Adam op" in caplog.text
    assert '"optimizer.params.torch_adam": true' in caplog.text
    caplog.clear()
    config["optimizer"]["params"]["torch_adam"] = True
    path.write_text(json.dumps(config))
    parse_args(["--config", str(path), "--run-dir", str(tmp_path / "run")], world_size=1)
    assert "fused Adam" not in caplog.text


def test_no_shipped_config_builds_fused_adam_on_a_cpu():
    """Issue 41, item 10: the shipped NVFP4 config still compiled DeepSpeed's fused Adam on a
    CPU (with the note of issue 33); every shipped config runs torch's Adam now."""
    for path in sorted((ROOT / "configs").rglob("*.hjson")):
        optimizer = load_ds_config(path)["optimizer"]
        assert optimizer["params"].get("torch_adam") is True, path.name


def test_the_title_names_the_model_that_was_built():
    """Issue 41, item 10: a 2 x 64 run of the NVFP4 config was titled "LLaMA-2 130M"; the title
    now carries the shape read off the model built, whatever the options overrode."""
    from gnmr_dist.train.ds_pretrain import model_line

    model = _tiny_llama(vocab=256, hidden=64, layers=2, heads=4)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    assert model_line(model, params) == f"Llama 2 x 64, {total / 1e6:.1f}M parameters"
    for p in params[1:]:
        p.requires_grad_(False)
    trained = params[0].numel() / 1e6
    assert model_line(model, params[:1]).endswith(f"parameters, {trained:.2f}M trained")
    for path in sorted((ROOT / "configs").rglob("*.hjson")):
        title = load_ds_config(path).get("pretrain", {}).get("title", "")
        assert not re.search(r"\d+[MB]\b", title), (path.name, title)  # no size in a title
