"""te_fp8 with TE's ``NVFP4BlockScaling`` as the low-cost recipe, and megatron's FP4 runs, on CPU.

The stand-in TE and megatron's own source text executed over it come from ``te_stand_ins``;
megatron's ``fp4_utils.get_fp4_context`` / ``get_fp4_recipe`` are read from the installed
megatron-core the same way. What the stand-ins cannot show (FP4 numerics, the GEMMs) is checked
on a Blackwell GPU by ``gnmr-gpu-check`` (:mod:`gnmr_dist.train.gpu_check`); on Hopper that
command checks the refusal.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import sys
import types

import pytest
import torch

from gnmr_dist.backends import LOW_COST, RECOVERY, get_backend, te_runtime
from gnmr_dist.backends.te_fp8 import TEFp8Backend
from gnmr_dist.integrations.megatron.operators import MEGATRON_OPERATORS
from tests.backends import te_stand_ins as stand_ins
from tests.backends.te_stand_ins import _exec, call, mcore_config, megatron_file, stack
from tests.requires import missing

fake_te = stand_ins.fake_te  # the fixtures of te_stand_ins
mcore = stand_ins.mcore

B200 = ("NVIDIA B200", (10, 0))
H200 = ("NVIDIA H200", (9, 0))
FP4_CONFIG = {"fp8": None, "fp8_recipe": "delayed", "fp4": "e2m1", "fp4_recipe": "nvfp4"}


@pytest.fixture
def device(monkeypatch):
    """Pretend the current CUDA device is ``(name, capability)`` (``None``: a CPU)."""

    def set_device(dev):
        monkeypatch.setattr(te_runtime, "cuda_device", lambda: dev)

    return set_device


def nvfp4_backend(**low):
    return TEFp8Backend(low_cost={"recipe": "nvfp4", **low})


# ------------------------------------------------------------------ the recipe and its device


def test_nvfp4_recipe_is_te_default_unless_told(fake_te, device):
    rec = fake_te()
    device(B200)
    be = nvfp4_backend()
    assert type(be.low_cost_recipe).__name__ == "NVFP4BlockScaling"
    assert be.low_cost_recipe.kwargs == {}  # TE's defaults: NVIDIA's recipe (RHT, SR, 2-D)
    off = nvfp4_backend(stochastic_rounding=False, hadamard=False, weight_2d=True)
    assert off.low_cost_recipe.kwargs == {
        "disable_stochastic_rounding": True,
        "disable_rht": True,
        "disable_2d_quantization": False,
    }
    assert be.recovery_recipe is None  # BF16
    fp8 = get_backend("te_fp8", low_cost={"recipe": "nvfp4"}, recovery={"recipe": "mxfp8"})
    assert type(fp8.recovery_recipe).__name__ == "MXFP8BlockScaling"
    assert fp8.recovery_recipe.kwargs == {"fp8_format": rec.recipe.Format.HYBRID}


def test_nvfp4_units_switch_to_bf16_or_fp8_inside_the_fp4_region(fake_te, device):
    rec = fake_te()
    device(B200)
    for recovery, inner_recipe in (("bf16", None), ("mxfp8", "MXFP8BlockScaling")):
        be = TEFp8Backend(low_cost={"recipe": "nvfp4"}, recovery={"recipe": recovery})
        _, layers = stack(rec.te, n=2)
        be.wrap(dict(enumerate(layers)))
        be.apply({1}, step=1)
        with be.autocast():
            layers[1](layers[0](torch.ones(2, 8)))
        outer = (True, be.low_cost_recipe, None)
        assert layers[0].seen == [(outer,)]
        inner = layers[1].seen[0][1]
        assert inner[0] == (inner_recipe is not None)
        if inner_recipe:
            assert type(inner[1]).__name__ == inner_recipe
        assert be.report().ran == {0: {LOW_COST}, 1: {RECOVERY}}
        assert be.fp8_ran(0) and be.fp8_ran(1) == (recovery != "bf16")


@pytest.mark.parametrize(
    ("dev", "match"),
    [
        (None, r"no CUDA device: it runs on the CPU"),
        (H200, r"this GPU, NVIDIA H200, has compute capability 9\.0 and none"),
        (("NVIDIA H100 80GB HBM3", (9, 0)), r"NVIDIA H100 80GB HBM3, has compute capability 9\.0"),
        (("NVIDIA L40S", (8, 9)), r"NVIDIA L40S, has compute capability 8\.9"),
    ],
)
def test_a_device_without_fp4_gemms_is_refused_by_name_before_any_region(
    fake_te, device, dev, match
):
    rec = fake_te()
    device(dev)
    with pytest.raises(RuntimeError, match=match) as err:
        nvfp4_backend()
    assert "te_fp8 recipe 'nvfp4' needs FP4 GEMMs" in str(err.value)
    assert "fp8_emulated" in str(err.value)  # what runs NVFP4 here instead
    assert rec.calls == [] and rec.active == []  # TE's autocast was never entered
    TEFp8Backend(low_cost={"recipe": "tensorwise"})  # FP8 still runs on this device


def test_te_own_refusal_is_passed_on(fake_te, device):
    reason = "Device compute capability 10.0 or higher required for NVFP4 execution."
    fake_te(support={"nvfp4": (False, reason)})
    device(B200)
    with pytest.raises(RuntimeError, match=r"recipe 'nvfp4' here: Device compute capability 10\.0"):
        nvfp4_backend()


def test_te_without_nvfp4_names_the_version(fake_te, device):
    fake_te(version="2.7.0", recipes=["DelayedScaling", "Float8CurrentScaling"])
    device(B200)
    with pytest.raises(RuntimeError, match=r"NVFP4BlockScaling\) needs transformer_engine >= 2\.8"):
        nvfp4_backend()


@pytest.mark.parametrize(
    ("blocks", "match"),
    [
        ({"low_cost": {"recipe": "tensorwise", "hadamard": True}}, r"hadamard is an option of"),
        ({"low_cost": {"recipe": "nvfp4", "weight_2d": "yes"}}, r"weight_2d is an option of"),
        ({"low_cost": {"recipe": "nvfp4", "amax_history_len": 8}}, r"applies only to recipe"),
        ({"recovery": {"recipe": "nvfp4"}}, r"gnmr\.recovery\.recipe must be one of"),
    ],
)
def test_nvfp4_options_are_checked(fake_te, device, blocks, match):
    fake_te()
    device(B200)
    with pytest.raises(ValueError, match=match):
        get_backend("te_fp8", **blocks)


# ------------------------------------------------------------------ megatron's FP4 runs


def megatron_fp4_context(rec, monkeypatch):
    """megatron's ``get_fp4_context`` (``fp4_utils``, the TE branch) over the stand-in TE."""
    path = megatron_file("core/fp4_utils.py")
    if path is None:
        missing("needs megatron-core's source")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    guards = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "HAVE_TE"]
    defs = [n for g in guards for n in g.body if isinstance(n, ast.FunctionDef)]
    assert {d.name for d in defs} >= {"get_fp4_recipe", "get_fp4_context"}
    rec.fp4_groups = []
    parallel_state = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: True,
        get_amax_reduction_group=lambda **kw: rec.fp4_groups.append(kw) or "amax-group",
    )
    enums = sys.modules["megatron.core.extensions.transformer_engine"]
    namespace = {
        "transformer_engine": sys.modules["transformer_engine"],
        "nullcontext": contextlib.nullcontext,
        "is_te_min_version": lambda v: True,
        "Fp4Recipe": enums.Fp4Recipe,
        "parallel_state": parallel_state,
        "torch": torch,
        "_get_custom_recipe": None,
        "TransformerConfig": object,
    }
    _exec(ast.Module(body=defs, type_ignores=[]), namespace, path)
    return namespace["get_fp4_context"]


def fp4_config(**overrides):
    fields = {
        **FP4_CONFIG,
        "num_layers": 4,
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 1,
        "fp4_param": False,
        "fp8_dot_product_attention": False,
    }
    return mcore_config(**(fields | overrides))


def test_megatron_fp4_operators_recover_through_te_quant_params(mcore, device, monkeypatch):
    rec, _, make = mcore()
    device(B200)
    get_fp4_context = megatron_fp4_context(rec, monkeypatch)
    config = fp4_config()
    for recovery in ("bf16", "mxfp8"):
        layers = [make("TERowParallelLinear", config, seed=i) for i in range(2)]
        be = TEFp8Backend(
            operators=MEGATRON_OPERATORS,
            low_cost={"recipe": "nvfp4"},
            recovery={"recipe": recovery},
        )
        be.wrap(dict(enumerate(layers)))
        assert be.switched_units == {0, 1}
        be.apply({1}, step=1)
        rec.calls.clear()
        with get_fp4_context(config, 1):  # a middle layer: megatron's NVFP4 region
            for layer in layers:
                call(layer, torch.ones(2, 8))
        nvfp4 = rec.calls[0][2]["fp8_recipe"]
        assert type(nvfp4).__name__ == "NVFP4BlockScaling"
        assert rec.calls[0][2]["fp8_group"] == "amax-group"
        outer = (True, nvfp4, "amax-group")
        assert layers[0].seen == [(outer,)]
        inner = layers[1].seen[0][1]
        if recovery == "bf16":  # megatron's own override: fp8_autocast(enabled=False)
            assert inner == (False, None, None) and not be.fp8_ran(1)
        else:
            assert type(inner[1]).__name__ == "MXFP8BlockScaling" and be.fp8_ran(1)
        assert be.report().ran == {0: {LOW_COST}, 1: {RECOVERY}}
        with get_fp4_context(config, 0):  # megatron's own first BF16 layer: nothing to do
            call(layers[1], torch.ones(2, 8))
        assert layers[1].seen[-1] == () and not layers[1].fp8


@pytest.mark.parametrize(
    ("config", "low", "match"),
    [
        (FP4_CONFIG, "tensorwise", r"fp4='e2m1', fp8=None \(recipe 'nvfp4'\) but gnmr\.low_cost"),
        ({"fp8": "hybrid", "fp8_recipe": "tensorwise"}, "nvfp4", r"recipe 'tensorwise'\) but"),
        ({**FP4_CONFIG, "fp4_recipe": "custom"}, "nvfp4", r"\(recipe 'custom'\) but"),
    ],
)
def test_megatron_fp4_and_the_low_cost_recipe_must_agree(mcore, device, config, low, match):
    _, _, make = mcore()
    device(B200)
    layer = make("TERowParallelLinear", mcore_config(**config))
    with pytest.raises(ValueError, match=match):
        TEFp8Backend(operators=MEGATRON_OPERATORS, low_cost={"recipe": low}).wrap({0: layer})


def test_megatron_enum_and_fields_this_backend_reads_exist(mcore):
    _, module, _ = mcore()
    assert module.Fp4Recipe("nvfp4").value == "nvfp4"
    fields = module.TEQuantizationRecipe.__dataclass_fields__
    assert "fp4_quantization_recipe" in fields and "override_quantized_autocast" in fields
    assert isinstance(module.Fp4Recipe.nvfp4, enum.Enum)


def test_nvfp4_without_transformer_engine_names_the_gpu_and_the_emulated_route():
    """Issue 33, item 6: the refusal on a host without TE (a CPU) was the generic "needs
    Transformer Engine and a CUDA GPU"; asked for NVFP4 it names Blackwell and fp8_emulated."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here: its import does not fail")
    with pytest.raises(ImportError) as err:
        get_backend("te_fp8", low_cost={"recipe": "nvfp4"}, recovery={"recipe": "bf16"})
    assert "Recipe 'nvfp4' also needs FP4 GEMMs: an NVIDIA GPU of compute capability 10.0" in str(
        err.value
    )
    assert "the 'fp8_emulated' backend runs NVFP4 emulated" in str(err.value)
    with pytest.raises(ImportError) as fp8:
        get_backend("te_fp8", low_cost={"recipe": "tensorwise"}, recovery={"recipe": "bf16"})
    assert "nvfp4" not in str(fp8.value) and "use the 'fp8_emulated' backend" in str(fp8.value)
