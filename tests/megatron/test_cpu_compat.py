"""megatron_patches.cpu: the switch itself (idempotent, reversible, refuses GPUs, version gate)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_patches.cpu as cpu
from megatron_patches import (
    cpu_compat,
    cpu_transformer_config,
    disable_cpu_compat,
    enable_cpu_compat,
    is_cpu_compat_enabled,
)


@pytest.fixture
def single_process_group():
    """A one-rank gloo group for megatron's collectives, torn down afterwards."""
    import torch.distributed as dist

    from tests.multiproc import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _always_disabled():
    disable_cpu_compat()
    yield
    disable_cpu_compat()


def _snapshot():
    """Every attribute the plan patches, as currently set (identity)."""
    return {(id(o), n): vars(o).get(n, cpu._MISSING) for o, n, _ in cpu._patch_plan()}


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

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match=r"0\.16\.x; found 0\.17\.0.*'0\.17'"):
        enable_cpu_compat()
    monkeypatch.setattr(cpu, "SUPPORTED_MEGATRON_VERSIONS", ("0.16", "0.17"))
    enable_cpu_compat()
    assert is_cpu_compat_enabled()


def test_failed_enable_rolls_back(monkeypatch):
    before = _snapshot()
    plan = cpu._patch_plan()

    def broken_plan():
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
        "import megatron_patches; print(megatron_patches.is_cpu_compat_enabled())"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "False"
