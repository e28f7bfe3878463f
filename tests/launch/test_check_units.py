"""``gnmr-launch check`` refuses an ``include``/``exclude`` that selects no unit, as the run does
(issue 41, item 10): the run refuses it when it builds its model
(``gnmr_dist.deepspeed.initialize``; Megatron-LM: ``setup_model_and_optimizer``), so check builds
the model the program's options describe on the meta device and asks the same question, with
the same message."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from gnmr_dist.train import launch
from tests.multiproc import torchrun

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "2", "--hidden", "32", "--seq-len", "16"]
TYPO = ["*.layer.*"]  # "layers"
NONE_SELECTED = "no units selected with units='operator', include=['*.layer.*'], exclude=[]; "


def _config(tmp_path: Path, **gnmr) -> str:
    path = tmp_path / "include.json"
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    block = {"backend": "act_quant", **gnmr}
    path.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer, "gnmr": block})
    )
    return str(path)


def _check(capsys, *argv: str) -> tuple[int, str]:
    code = launch.main(["check", "--world-size", "1", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def _initialize_refuses(config: str, *options: str) -> str:
    """What ``gnmr_dist.deepspeed.initialize`` says to the program's own model (it refuses
    before any process group, so this process can ask)."""
    import gnmr_dist.deepspeed as gds
    from gnmr_dist.train import ds_pretrain

    args = ds_pretrain.parse_args(["--config", config, *options], world_size=1)
    model = ds_pretrain.build_model(args, 256)
    ds = {k: v for k, v in args.ds_config.items() if k != "gnmr"}
    with pytest.raises(ValueError) as err:
        gds.initialize(model=model, config={**ds, "gnmr": args.gnmr_block})
    return str(err.value)


@pytest.mark.slow
def test_deepspeed_check_refuses_an_include_that_matches_nothing(capsys, tmp_path):
    config = _config(tmp_path, include=TYPO)
    code, said = _check(capsys, config, *TINY)
    assert code == 2 and "nothing was started" in said
    run = _initialize_refuses(config, *TINY)
    assert run.startswith(NONE_SELECTED)
    assert f"{config} (deepspeed): {run}\n" in said  # the run's own message
    assert "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj" in run
    code, said = _check(capsys, _config(tmp_path, include=["*.layers.1.*"]), *TINY)
    assert code == 0 and "is valid" in said
    code, said = _check(capsys, _config(tmp_path, exclude=["*"]), *TINY)  # excludes them all
    assert (
        code == 2 and "no units selected with units='operator', include=[], exclude=['*']" in said
    )


def test_the_model_shape_comes_from_init_from_and_lora_adapters_count(capsys, tmp_path):
    """``--init-from DIR``: the directory's shape (2 layers), not ``--layers``; with
    ``--lora-rank`` the adapted model's units."""
    from tests.cli.test_ds_pretrain import _tiny_llama

    init = tmp_path / "hf"
    _tiny_llama(vocab=64, hidden=32, layers=2, heads=4).save_pretrained(init)
    lora = ["--init-from", str(init), "--lora-rank", "2", "--layers", "8"]
    layer5 = _config(tmp_path, include=["*.layers.5.*"])
    code, said = _check(capsys, layer5, *lora)
    assert code == 2 and "include=['*.layers.5.*']" in said
    assert "the model's operator units are: model.layers.0.self_attn.q_proj," in said
    assert "(15 in all)" in said  # 2 layers x 7 and lm_head; --layers 8 would make 57
    assert f"{layer5} (deepspeed): {_initialize_refuses(layer5, *lora)}\n" in said
    code, said = _check(capsys, _config(tmp_path, include=["*.layers.1.*"]), *lora)
    assert code == 0, said


@pytest.mark.slow
def test_megatron_check_refuses_it_with_the_message_the_run_dies_with(tmp_path):
    """``check`` of the Megatron demo set (megatron-core's own layers, and the same set on
    Transformer Engine's, checked from a host without TE), then the program itself: 2
    processes under torchrun stop in ``setup_model_and_optimizer`` with the same message."""
    from tests.integrations.megatron.settings import launch_checks, training_env

    typo, fine = tmp_path / "typo.json", tmp_path / "fine.json"
    typo.write_text(json.dumps({"backend": "act_quant", "include": TYPO}))
    fine.write_text(json.dumps({"backend": "act_quant", "include": ["*.layers.3.*"]}))
    check = "check --world-size 2 megatron/demo_cpu --gnmr-config"
    te = "--transformer-impl transformer_engine"
    cases = [f"{check} {typo}", f"{check} {typo} {te}", f"{check} {fine}", f"{check} {fine} {te}"]
    results = launch_checks([shlex.split(c) for c in cases], cwd=ROOT)
    (local, _, said), (on_te, _, said_te), *valid = results
    assert local == on_te == 2 and "nothing was started" in said
    assert [code for code, _, _ in valid] == [0, 0]
    units = (
        "the model's operator units are: decoder.layers.0.self_attention.linear_proj, "
        "decoder.layers.0.self_attention.linear_qkv, decoder.layers.0.mlp.linear_fc1, "
        "decoder.layers.0.mlp.linear_fc2, decoder.layers.1.self_attention.linear_proj, "
        "decoder.layers.1.self_attention.linear_qkv, ... (17 in all)"
    )
    expected = f"{NONE_SELECTED}{units}; fix gnmr.include / gnmr.exclude"
    assert f"(megatron): {expected}" in said and f"(megatron): {expected}" in said_te
    job = launch.build_job("megatron/demo_cpu", ["--gnmr-config", str(typo)])
    run = subprocess.run(  # outputs under the working directory: tmp_path
        [*torchrun(2), "-m", "gnmr_dist.cli.megatron_pretrain", *job.args, "--train-iters", "20"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=training_env(),
        timeout=540,
    )
    assert run.returncode != 0
    assert f"ValueError: {expected}" in run.stderr
    assert "setup_model_and_optimizer" in run.stderr
