"""megatron_patches.cpu: the switch itself (idempotent, reversible, refuses GPUs, version gate),
and megatron-core training on CPU at the settings Megatron users run, on every release we support.

The matrix: each setting of ``tests/integrations/megatron/settings.py`` (fp32 DP2; bf16 with bf16
and with fp32 grad buffers; the distributed optimizer in fp32 and bf16; TP2 + sequence parallel; PP2
with two virtual stages per rank; TP2 x DP2 distributed optimizer bf16) x each release in
``MEGATRON_VERSIONS``. One set of worker processes per release trains every setting for
``STEPS`` steps with megatron's schedule, ``finalize_model_grads`` and megatron's optimizer, and
a float64 replay of the full model on the same micro-batches gives the numbers to match:

* the loss of every step (step 1: the weights are the full model's, so this is the "TP1 loss");
* megatron's own grad norm, as ``optimizer.step()`` returns it, at every step;
* the reduced gradient norm of every parameter, read from megatron's grad buffers (each DP
  rank's owned shard with the distributed optimizer), at step 1.

Tolerances. fp32: 1e-6 relative on losses, 1e-5 on norms (measured, identical on all three
releases: losses <= 5.4e-8, megatron's grad norm <= 3.2e-7, per-parameter <= 1.3e-7; fp32
summation order differs between layouts). bf16 keeps 8 significant bits (unit roundoff
u = 2**-8 = 3.9e-3) in weights, activations and, with ``grad_reduce_in_fp32=False``, in the grad
buffers; a loss or a norm sums many such numbers, whose rounding errors mostly cancel. Losses:
2.5e-4 relative (measured <= 6.9e-5; one AdamW step moves the loss by >= 1.1e-3, so a lost
update still fails). Grad norm at step 1: 5e-4 (measured <= 1.4e-4); at steps 2-3: u (measured
<= 1.8e-3: AdamW's first steps are about lr * sign(g), so bf16 noise in small gradients becomes
whole-size update differences). Per parameter at step 1: u relative plus 1e-3 of the global
norm absolute (measured <= 3.3e-3 relative on parameters above 1e-3 of the global norm,
<= 3.6e-4 of the global norm absolute: small parameters are dominated by rounding).
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

from tests.requires import require

require("megatron.core")

from gnmr_dist.testing import megatron_cpu as cpu
from gnmr_dist.testing.megatron_cpu import (
    cpu_compat,
    cpu_transformer_config,
    disable_cpu_compat,
    enable_cpu_compat,
    is_cpu_compat_enabled,
)


@pytest.fixture
def single_process_group():
    """A one-rank gloo group for megatron's collectives (an in-process store: no port), torn
    down afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _always_disabled():
    disable_cpu_compat()
    yield
    disable_cpu_compat()


_NOT_OWN = object()  # the owner's __dict__ has no such name (a class method, an inherited one)


def _snapshot():
    """Every attribute the plan patches, as currently set (identity)."""
    return {(id(o), n): vars(o).get(n, _NOT_OWN) for o, n, _ in cpu._patch_plan()}


def test_enable_is_idempotent_and_disable_restores_identity():
    before = _snapshot()
    enable_cpu_compat()
    n = len(cpu._APPLIED)
    enable_cpu_compat()
    assert is_cpu_compat_enabled() and len(cpu._APPLIED) == n == len(before)
    assert all(vars(p.owner)[p.name] is not p.original for p in cpu._APPLIED)
    assert torch.cuda.current_device() == torch.device("cpu")
    disable_cpu_compat()
    assert not is_cpu_compat_enabled()
    after = _snapshot()
    assert all(after[k] is before[k] for k in before)


def test_context_manager_nests():
    with cpu_compat():
        with cpu_compat():
            assert is_cpu_compat_enabled()
        assert is_cpu_compat_enabled()  # the inner block did not enable, so it does not disable
    assert not is_cpu_compat_enabled()


def test_refuses_on_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="never active on a GPU"):
        enable_cpu_compat()
    assert not is_cpu_compat_enabled()


def test_version_gate_names_the_version(monkeypatch):
    from megatron.core import package_info

    assert cpu.SUPPORTED_MEGATRON_VERSIONS == ("0.16", "0.17", "0.19")
    monkeypatch.setattr(package_info, "__version__", "0.18.0")
    with pytest.raises(RuntimeError, match=r"0\.19\.x; found 0\.18\.0.*'0\.18' row"):
        enable_cpu_compat()
    from gnmr_dist.integrations.megatron import versions

    row = dataclasses.replace(versions.SERIES["0.16"], series="0.18", checked="0.18.0")
    monkeypatch.setitem(versions.SERIES, "0.18", row)  # the one table every gate reads
    enable_cpu_compat()
    assert is_cpu_compat_enabled()


def test_version_specific_patches_follow_the_series():
    """``torch.cuda.current_stream`` is patched from 0.19 on only (named in the plan)."""
    stream = [(o, n) for o, n, _ in cpu._patch_plan("0.19.2") if n == "current_stream"]
    assert stream == [(torch.cuda, "current_stream")]
    for version in ("0.16.1", "0.17.1"):
        assert all(n != "current_stream" for _, n, _ in cpu._patch_plan(version))


def test_bf16_type_strings_and_sequence_parallel_norm():
    """The optimizers' type checks see CUDA names; the torch norm supports SP and marks weights."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    t = torch.zeros(2, dtype=torch.bfloat16)
    config = cpu_transformer_config(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    with cpu.optimizer._tensor_type_reports_cuda():
        assert (
            t.type() == "torch.cuda.BFloat16Tensor" and t.float().type() == "torch.cuda.FloatTensor"
        )
        assert t.type(torch.float32).dtype == torch.float32  # a conversion, unchanged
    assert t.type() == "torch.BFloat16Tensor"
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config, 8)
    with cpu_compat():
        norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.LayerNorm) and config.sequence_parallel
    assert [p.sequence_parallel for p in norm.parameters()] == [True, True]


def test_failed_enable_rolls_back(monkeypatch):
    before = _snapshot()
    plan = cpu._patch_plan()

    def broken_plan(version=None):
        return [*plan[:3], (object(), "x", None)]  # setattr on a bare object() fails

    monkeypatch.setattr(cpu, "_patch_plan", broken_plan)
    with pytest.raises((AttributeError, TypeError)):
        enable_cpu_compat()
    assert not is_cpu_compat_enabled()
    monkeypatch.undo()
    after = _snapshot()
    assert all(after[k] is before[k] for k in before)


def test_cpu_config_rejects_gpu_only_settings():
    with pytest.raises(ValueError, match="gradient_accumulation_fusion"):
        cpu_transformer_config(
            num_layers=2, hidden_size=8, num_attention_heads=2, gradient_accumulation_fusion=True
        )
    config = cpu_transformer_config(num_layers=2, hidden_size=8, num_attention_heads=2)
    assert config.use_cpu_initialization and config.pipeline_dtype == torch.float32


def test_grad_norm_and_clip_match_torch(single_process_group):
    from megatron.core.optimizer import clip_grads

    grads = [torch.randn(5, 3), torch.randn(7)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()
    with cpu_compat():
        norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=norm / 4, total_norm=norm)
        clipped = clip_grads.get_grad_norm_fp32([p.grad for p in params])
        inf_norm = clip_grads.get_grad_norm_fp32([p.grad for p in params], norm_type=float("inf"))
    assert norm == pytest.approx(expected, rel=1e-6)
    assert clipped == pytest.approx(expected / 4, rel=1e-5)
    assert inf_norm == pytest.approx(max(p.grad.abs().max().item() for p in params), rel=1e-6)


def test_imports_without_megatron():
    code = (
        "import sys; sys.modules['megatron'] = None;"
        "from gnmr_dist.testing import megatron_cpu; print(megatron_cpu.is_cpu_compat_enabled())"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- the settings matrix

STEPS = 3
PRELOAD = (
    "megatron.core.distributed",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "gnmr_dist.testing.megatron_cpu",
)
"""Imported once per release by ``multiproc.run_jobs``; every rank is forked from that process."""

FP32_TOL = {"loss": 1e-6, "norm": 1e-5, "param": 1e-5}
BF16_U = 2.0**-8
BF16_TOL = {"loss": 2.5e-4, "norm": 5e-4, "later_norm": BF16_U, "param": BF16_U}


def _gpt(chunk):
    """The GPTModel inside a chunk (DDP, then Float16Module for bf16)."""
    while not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _facts(chunks, opt) -> dict:
    """The layout as this rank sees it: optimizer classes, dtypes, layer numbers, SP marks."""
    from gnmr_dist.distributed.units import global_param_names
    from gnmr_dist.integrations.megatron.operators import MEGATRON_MARKS

    named = [
        (global_param_names(c, marks=MEGATRON_MARKS)[local], p)
        for c in chunks
        for local, p in c.named_parameters()
    ]
    return {
        "optimizers": [type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])],
        "param_dtypes": {str(p.dtype) for _, p in named},
        "grad_dtypes": {str(p.main_grad.dtype) for _, p in named},
        "layer_numbers": [[layer.layer_number for layer in _gpt(c).decoder.layers] for c in chunks],
        "names": {n for n, _ in named},
        "sequence_parallel": {n for n, p in named if getattr(p, "sequence_parallel", False)},
    }


def _train(setting, full, ref) -> dict:
    """Train ``setting`` ``STEPS`` steps from ``full``'s weights; every number the tests need."""
    from megatron.core import parallel_state as ps

    from tests.integrations.megatron import settings

    start = time.perf_counter()
    chunks, opt = settings.build(setting, full)
    out = {"facts": _facts(chunks, opt), "losses": [], "norms": [], "ok": []}
    for step in range(STEPS):
        out["losses"].append(settings.train_step(chunks, step))
        if step == 0:
            out["param_norms"] = settings.grad_norms_by_param(chunks)
        ok, norm, _ = opt.step()
        out["ok"].append(bool(ok))
        out["norms"].append(float(norm))
    out["seconds"] = time.perf_counter() - start
    out["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    ps.destroy_model_parallel()
    out["ref"] = {
        "losses": ref.losses,
        "norms": ref.grad_norms,
        "param_norms": {n: float(g.norm()) for n, g in ref.grads[0].items()},
        "initial_losses": ref.initial_losses,
    }
    return out


def _settings_worker(rank, world, names):
    """Train every setting in ``names`` on this world; a setting's failure is its result.

    The full model and its float64 replay depend only on the DP size: computed once per DP size.
    """
    import warnings

    from megatron.core import parallel_state as ps

    from tests.integrations.megatron import settings

    warnings.filterwarnings("ignore")
    enable_cpu_compat()
    results: dict = {"version": settings.megatron_version()}
    chosen = [settings.SETTINGS_BY_NAME[n] for n in names]
    with settings.full_layout():
        full = settings.full_model()
        refs = {dp: settings.reference(full, dp, STEPS) for dp in {s.dp for s in chosen}}
    for setting in chosen:
        try:
            results[setting.name] = _train(setting, full, refs[setting.dp])
        except Exception:
            results[setting.name] = traceback.format_exc()
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    return results


def _ranks(version: str, name: str) -> list[dict]:
    return _releases().ranks(version, name)


def _releases():
    """The matrix runs, built once (the settings module imports torch.distributed helpers)."""
    global _RUNS
    if _RUNS is None:
        from tests.integrations.megatron.settings import ReleaseRuns

        _RUNS = ReleaseRuns(_settings_worker, preload=PRELOAD)
    return _RUNS


_RUNS = None


def _matrix_params():
    from tests.integrations.megatron.settings import matrix_params

    return matrix_params()


@pytest.mark.parametrize("name, version", _matrix_params())
def test_setting_trains_like_the_full_model(name, version):
    """Loss, megatron's grad norm and per-parameter norms equal the float64 full-model replay."""
    from tests.integrations.megatron.settings import SETTINGS_BY_NAME

    setting = SETTINGS_BY_NAME[name]
    tol = BF16_TOL if setting.bf16 else FP32_TOL
    ranks = _ranks(version, name)
    ref = ranks[0]["ref"]
    for r in ranks:
        assert r["ok"] == [True] * STEPS
        assert r["ref"] == ref  # every rank replayed the same full model
        assert r["losses"] == pytest.approx(ref["losses"], rel=tol["loss"], abs=0)
        assert r["norms"][0] == pytest.approx(ref["norms"][0], rel=tol["norm"], abs=0)
        later = tol.get("later_norm", tol["norm"])
        assert r["norms"][1:] == pytest.approx(ref["norms"][1:], rel=later, abs=0)
    for step in range(1, STEPS):  # the loss check can see a lost optimizer update
        moved = abs(ref["losses"][step] - ref["initial_losses"][step]) / ref["losses"][step]
        assert moved > 2 * tol["loss"], (step, moved)
    got, want = ranks[0]["param_norms"], ref["param_norms"]
    assert set(got) == set(want) and all(r["param_norms"] == got for r in ranks)
    atol = (1e-6 if not setting.bf16 else 1e-3) * ref["norms"][0]
    bad = {
        n: (got[n], want[n]) for n in want if abs(got[n] - want[n]) > tol["param"] * want[n] + atol
    }
    assert not bad, bad
    assert math.sqrt(sum(v * v for v in got.values())) == pytest.approx(
        ranks[0]["norms"][0], rel=tol["param"]
    )


@pytest.mark.parametrize("name, version", _matrix_params())
def test_setting_layout(name, version):
    """The optimizer, buffers, layer numbering and SP marks are the ones megatron uses for it."""
    from tests.integrations.megatron import gpt
    from tests.integrations.megatron.settings import SETTINGS_BY_NAME

    setting = SETTINGS_BY_NAME[name]
    ranks = _ranks(version, name)
    optimizer = (
        "DistributedOptimizer"
        if setting.distributed_optimizer
        else "Float16OptimizerWithFloat16Params"
        if setting.bf16
        else "FP32Optimizer"
    )
    low = setting.bf16 and not setting.grad_reduce_in_fp32
    per_chunk = gpt.MODEL["num_layers"] // (setting.pp * (setting.vpp or 1))
    for r in ranks:
        facts = r["facts"]
        assert facts["optimizers"] == [optimizer]
        assert facts["param_dtypes"] == {"torch.bfloat16" if setting.bf16 else "torch.float32"}
        assert facts["grad_dtypes"] == {"torch.bfloat16" if low else "torch.float32"}
        # megatron's offsets: chunk v of pipeline rank p holds global stage v * pp + p
        assert facts["layer_numbers"] == [
            [(v * setting.pp + r["pp_rank"]) * per_chunk + i + 1 for i in range(per_chunk)]
            for v in range(setting.vpp or 1)
        ]
    names = set().union(*(r["facts"]["names"] for r in ranks))
    assert names == set(ranks[0]["ref"]["param_norms"])  # every parameter lives somewhere
    # SP: the norms (our CPU norm, like FusedLayerNorm/TENorm) and the row-parallel biases
    # (megatron's RowParallelLinear) are replicated over TP but fed a sequence slice per rank
    marked = set().union(*(r["facts"]["sequence_parallel"] for r in ranks))
    norms = {n for n in names if "layernorm" in n}
    row_biases = {n for n in names if n.endswith(("linear_proj.bias", "linear_fc2.bias"))}
    assert marked == (norms | row_biases if setting.sequence_parallel else set())
    assert len(norms) == 2 * (2 * gpt.MODEL["num_layers"] + 1)  # weight + bias, 2 per layer + final
    assert len(row_biases) == 2 * gpt.MODEL["num_layers"]


def test_missing_release_skips_locally_and_fails_on_ci(monkeypatch, tmp_path):
    from tests.integrations.megatron import settings

    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert settings.megatron_path("0.17.1") is None and settings.version_sys_path("0.17.1") == []
    assert settings.megatron_path("0.19.2") == str(tmp_path / "mcore" / "0.19.2")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"0\.19\.2 is not installed"):
        settings.version_sys_path("0.19.2")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run every version"):
        settings.version_sys_path("0.19.2")
    Path(tmp_path, "mcore", "0.19.2").mkdir(parents=True)
    Path(tmp_path, "mcore", "0.19.2", ".installed").touch()
    assert settings.version_sys_path("0.19.2") == [str(tmp_path / "mcore" / "0.19.2")]
    with pytest.raises(ValueError, match="unknown megatron-core version"):
        settings.megatron_path("0.18.0")
