"""megatron_pretrain with Megatron-LM's LLaMA options: SwiGLU, RMSNorm, RoPE, no biases, bf16.

Real processes over gloo, as in test_pretrain.py, with tiny models and few iterations:

* a LLaMA-shaped model (``--swiglu --normalization RMSNorm --position-embedding-type rope
  --disable-bias-linear``) is what the options say, and its TP2 shards of the gated
  ``linear_fc1`` are ``[gate chunk; up chunk]`` of the TP1 weight, so TP1 and TP2 train the same
  function (the same per-iteration losses);
* ``--bf16`` (``Float16Module`` + megatron's fp16/bf16 optimizer on CPU) trains on a small
  repetitive text, GNMR reads the fp32 ``main_grad`` buffers and makes decisions (a gradient
  spike moves the recovery budget to the spiked layer);
* the Transformer Engine and FP8 options are refused at parse time on this CPU host (exit 2).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core")

from gnmr_dist.integrations.megatron_pretrain import parse_args
from tests import multiproc

pytestmark = pytest.mark.slow

ITERS = 4
LLAMA = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 128 "
    "--micro-batch-size 2 --global-batch-size 4 --optimizer adam --lr 1e-3 --clip-grad 1.0 "
    f"--seed 1234 --train-iters {ITERS} --log-interval 100 --data synthetic "
    "--swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 10000 "
    "--disable-bias-linear --untie-embeddings-and-output-weights"
).split()
FFN = 128  # Megatron-LM's SwiGLU default for hidden 64: int(4 * 64 * 2 / 3 / 64) * 64
NORMS = ("input_layernorm", "pre_mlp_layernorm", "final_layernorm")

BF16_ITERS, SPIKE = 12, 10
BF16 = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 256 "
    "--micro-batch-size 2 --global-batch-size 4 --optimizer adam --lr 3e-3 --clip-grad 1.0 "
    f"--seed 1234 --train-iters {BF16_ITERS} --log-interval 100 --bf16 --swiglu "
    f"--normalization RMSNorm --position-embedding-type rope --inject-grad-spike {SPIKE}:1"
).split()
GNMR = {
    "backend": "act_quant",
    "low_cost": {"bits": 8, "group_size": 32},
    "recovery": {"bits": 32},
    "max_active": 2, "lock_steps": 2, "window": 6, "warmup_steps": 4,
}  # fmt: skip


# ------------------------------------------------------------------------------ workers


def _worker(rank, world, jobs):
    return [_JOBS[kind](argv) for kind, argv in jobs]


def _train(argv):
    from gnmr_dist.integrations.megatron_pretrain import pretrain

    return pretrain(parse_args(argv))


def _model(argv):
    """The model pretrain builds: fc1 weights by global name, norm classes, parameter names."""
    from gnmr_dist.distributed.units import global_param_names
    from gnmr_dist.integrations.megatron_pretrain import _build_gpt, _distributed

    args = parse_args(argv)
    with _distributed(args):
        model = _build_gpt(args)
        names = global_param_names(model)
        params = {names[n]: p for n, p in model.named_parameters()}
        fc1 = {n: p for n, p in params.items() if "linear_fc1" in n}
        return {
            "fc1": {n: p.detach().clone() for n, p in fc1.items()},
            "fc1_stride": {getattr(p, "partition_stride", 1) for p in fc1.values()},
            "names": sorted(params),
            "norms": {type(m).__name__ for n, m in model.named_modules() if n.endswith(NORMS)},
            "rotary": hasattr(model, "rotary_pos_emb"),
            "config": (
                model.config.gated_linear_unit,
                model.config.activation_func.__name__,
                model.config.normalization,
                model.config.add_bias_linear,
            ),
        }


def _bf16_step(argv):
    """One bf16 iteration: dtypes of model/main params and grads, GNMR's norms vs main_grad."""
    from gnmr_dist.integrations.megatron_pretrain import _build, _distributed, _iteration

    args = parse_args(argv)
    with _distributed(args) as device:
        run = _build(args, device)
        _iteration(run, 1)
        reg = run.gnmr.registry
        sq = torch.zeros(reg.num_units + 1, dtype=torch.float64)
        for p, slot in zip(reg.params, reg.param_slots.tolist(), strict=True):
            sq[slot] += p.main_grad.double().square().sum()
        inner = getattr(run.optimizer, "chained_optimizers", [run.optimizer])
        return {
            "wrapper": type(run.model.module).__name__,
            "optimizers": {type(opt).__name__ for opt in inner},
            "params": {p.dtype for p in run.model.parameters()},
            "main_grads": {p.main_grad.dtype for p in run.model.parameters()},
            "main_params": {p.dtype for o in inner for g in o.fp32_from_float16_groups for p in g},
            "monitor": run.gnmr.runtime.last_norms.norms.clone(),
            "from_main_grad": sq[:-1].sqrt(),
        }


_JOBS = {"train": _train, "model": _model, "bf16_step": _bf16_step}


def _tp(n):
    return ["--tensor-model-parallel-size", str(n)]


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    words = "the quick brown fox jumps over the lazy dog while a small cat sleeps on the mat"
    path.write_text(" ".join([words] * 40))
    return str(path)


@pytest.fixture(scope="module")
def gnmr_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "gnmr.json"
    path.write_text(json.dumps({"gnmr": GNMR}))
    return str(path)


@pytest.fixture(scope="module")
def single(text, gnmr_config):
    """One process: the TP1 LLaMA model and run, then the bf16 step and run."""
    bf16 = [*BF16, "--data", text, "--gnmr-config", gnmr_config]
    jobs = [("model", LLAMA), ("train", LLAMA), ("bf16_step", [*bf16, "--clip-grad", "100"]),
            ("train", bf16)]  # fmt: skip
    [[model, run, step, bf16_run]] = multiproc.run(_worker, 1, jobs)
    return {"model": model, "run": run, "bf16_step": step, "bf16_run": bf16_run}


@pytest.fixture(scope="module")
def tp2():
    """Two processes: the TP2 LLaMA model and run."""
    argv = [*LLAMA, *_tp(2)]
    return multiproc.run(_worker, 2, [("model", argv), ("train", argv)])


# ------------------------------------------------------------------------------ LLaMA shape


def test_llama_options_build_what_they_say(single):
    model = single["model"]
    assert model["config"] == (True, "silu", "RMSNorm", False)
    assert model["norms"] == {"RMSNorm"}  # every layer norm and the final norm: torch's RMSNorm
    assert model["rotary"] and not any("position_embeddings" in n for n in model["names"])
    assert not any(n.endswith(".bias") for n in model["names"])  # --disable-bias-linear
    assert "output_layer.weight" in model["names"]  # untied (the flag is a no-op)
    assert model["fc1"]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * FFN, 64)


def test_tp2_swiglu_shards_are_gate_and_up_chunks(single, tp2):
    full = single["model"]["fc1"]
    for rank, [model, _] in enumerate(tp2):
        assert model["fc1_stride"] == {2}
        for name, shard in model["fc1"].items():
            gate, up = full[name][:FFN], full[name][FFN:]
            half = FFN // 2
            expected = torch.cat([gate[rank * half :][:half], up[rank * half :][:half]])
            assert torch.equal(shard, expected), f"rank {rank} {name}"
            # a contiguous TP slice (the non-gated rule) would give other rows
            assert not torch.equal(shard, full[name][rank * FFN :][:FFN])


def test_tp2_trains_the_same_function_as_tp1(single, tp2):
    ref = single["run"]
    assert ref["iteration"] == list(range(1, ITERS + 1))
    for _, run in tp2:
        assert run["iteration"] == ref["iteration"]
        assert run["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


# ------------------------------------------------------------------------------ bf16


def test_bf16_is_megatrons_mixed_precision(single):
    step = single["bf16_step"]
    assert step["wrapper"] == "Float16Module"
    assert step["optimizers"] == {"Float16OptimizerWithFloat16Params"}
    assert step["params"] == {torch.bfloat16}
    assert step["main_grads"] == {torch.float32} and step["main_params"] == {torch.float32}
    # GNMR's per-unit norms (carried in megatron's clip-norm all-reduce) are main_grad's
    assert step["monitor"].numel() == 8 and bool((step["monitor"] > 0).all())
    torch.testing.assert_close(step["monitor"], step["from_main_grad"], rtol=1e-5, atol=0)


def test_bf16_trains_and_gnmr_decides(single):
    run = single["bf16_run"]
    loss = run["loss"]
    assert all(torch.isfinite(torch.tensor(loss)))
    assert sum(loss[-3:]) / 3 < loss[0] - 1.0  # byte-level text: 5.6 -> ~3.2
    assert run["step"] == list(range(1, BF16_ITERS + 1))  # a decision every iteration
    spiked = run["active"][SPIKE - 1]
    assert run["grad_norm"][SPIKE - 1] > 10 * run["grad_norm"][SPIKE - 2]
    assert len(spiked) == 2  # the budget, spent on the spiked layer
    assert all(run["units"][u].startswith("decoder.layers.1.") for u in spiked)


# ------------------------------------------------------------------------------ user errors


def test_swiglu_ffn_default_is_megatron_lms(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    llama7b = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32"]
    assert parse_args([*llama7b, "--swiglu"]).ffn_hidden_size == 10880  # int(4h*2/3/64)*64
    assert parse_args([*llama7b, "--swiglu", "--ffn-hidden-size", "11008"]).ffn_hidden_size == (
        11008
    )
    assert parse_args(llama7b).ffn_hidden_size == 4 * 4096


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fp8-format", "hybrid", "--bf16"],
         r"--fp8-format hybrid runs in Transformer Engine's layers: add --transformer-impl "
         r"transformer_engine"),
        (["--transformer-impl", "transformer_engine", "--fp8-format", "e4m3"],
         r"--fp8-format e4m3 needs --bf16"),
        (["--swiglu", "--hidden-size", "16"],
         r"--swiglu with --hidden-size 16.*is 0.*--ffn-hidden-size"),
        (["--fp8-recipe", "custom"], r"invalid choice: 'custom'"),
    ],
    ids=["fp8-without-te", "fp8-without-bf16", "swiglu-ffn-zero", "fp8-recipe-custom"],
)  # fmt: skip
def test_option_errors_exit_2(monkeypatch, capsys, extra, message):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as err:
        parse_args([*LLAMA, *extra])
    assert err.value.code == 2
    assert_matches(capsys.readouterr().err, message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
@pytest.mark.parametrize(
    "extra", [[], ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]],
    ids=["te", "te-fp8"],
)  # fmt: skip
def test_transformer_engine_on_cpu_exits_2_naming_the_fix(monkeypatch, capsys, extra):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as err:
        parse_args([*LLAMA, "--transformer-impl", "transformer_engine", *extra])
    assert err.value.code == 2
    assert_matches(
        capsys.readouterr().err,
        r"--transformer-impl transformer_engine needs CUDA.*install Transformer Engine.*"
        r"docker image.*--transformer-impl local",
    )


def assert_matches(text, pattern):
    import re

    assert re.search(pattern, text, re.S), text
