"""``gnmr.gemms``: a recovered unit recovers a subset of its GEMMs (fprop, dgrad, wgrad).

For ``fp8_emulated`` (FP8 e4m3 per tensor, and NVFP4 with stochastic rounding on both paths)
every non-empty subset is run against two reference runs of the same step and seeds, all units
recovered and none: each GEMM in the subset must give bit for bit the recovered run's result
(``y`` for fprop, ``dx`` for dgrad, ``dW`` for wgrad), each GEMM outside it the low-cost run's.
The default must be today's recovery path, the block's errors name key, value and allowed
names, and the backends that cannot run a subset refuse it when built. ``te_fp8``'s route
choice and quantizer factory run here against stand-ins of Transformer Engine's classes; the
routes themselves against a real TE only under the ``gpu`` marker. DeepSpeed ZeRO-2 (2 ranks)
and megatron-core TP2 (gloo, CPU) runs of an fprop-only subset are marked ``slow``.
"""

from __future__ import annotations

import itertools
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gnmr_dist.backends import PrecisionBackend, get_backend
from gnmr_dist.backends.emulated_linear import EmulatedCall
from gnmr_dist.backends.gemms import ALL_GEMMS, GEMMS, parse_gemms
from gnmr_dist.backends.numerics.rounding import sr_seed
from gnmr_dist.backends.te_gemms import (
    CUSTOM,
    OVERRIDE,
    REGIONS,
    TEFeatures,
    choose_route,
    split_layouts,
    subset_qfactory,
)
from gnmr_dist.integrations.config import GNMRBlock

SUBSETS = [list(s) for k in (1, 2, 3) for s in itertools.combinations(GEMMS, k)]
FP8 = ({"format": "e4m3", "granularity": "tensor"}, {"format": "bf16"})
NVFP4 = ({"format": "e2m1"}, {"format": "e4m3", "stochastic_rounding": True, "seed": 5})
"""(low_cost, recovery): NVIDIA's NVFP4 recipe (1 x 16 / 16 x 16 blocks, stochastic rounding of
dy, the Hadamard transform on wgrad) against block-scaled e4m3 that also rounds dy
stochastically, with another seed: every GEMM's draws belong to its path."""
STEP, MICRO = 3, 2


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run_linear(low, rec, gemms, plan, *, step=STEP, track=False):
    """One optimizer step of a wrapped ``nn.Linear(64, 48)`` over MICRO micro-batches:
    ``[(y, dx, dW), ...]`` per micro-batch (dW of that micro-batch) and the error sums."""
    lin = nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(_rand(48, 64, seed=1) / 8)
        lin.bias.copy_(_rand(48, seed=2))
    backend = get_backend("fp8_emulated", low_cost=low, recovery=rec, gemms=gemms)
    backend.wrap({0: lin})
    if track:
        backend.track_errors(1)
    backend.apply(plan, step=step)
    out = []
    for m in range(MICRO):
        x = _rand(2, 16, 64, seed=10 + m).requires_grad_()
        y = lin(x)
        y.backward(_rand(2, 16, 48, seed=20 + m))
        out.append((y.detach(), x.grad, lin.weight.grad.clone()))
        lin.weight.grad = None
    sums = backend.error_sums(torch.device("cpu")) if track else None
    return out, sums


@pytest.mark.parametrize("paths", [FP8, NVFP4], ids=["fp8_e4m3_tensor", "nvfp4"])
def test_each_gemm_runs_bitwise_on_the_path_the_subset_gives_it(paths):
    low, rec = paths
    all_low, _ = run_linear(low, rec, None, set())
    all_rec, _ = run_linear(low, rec, None, {0})
    for a, b in zip(all_low, all_rec, strict=True):  # the two paths differ in every GEMM
        assert all(not torch.equal(u, v) for u, v in zip(a, b, strict=True))
    for gemms in SUBSETS:
        mixed, _ = run_linear(low, rec, gemms, {0})
        for m, got in enumerate(mixed):
            for i, gemm in enumerate(GEMMS):
                want = (all_rec if gemm in gemms else all_low)[m][i]
                assert torch.equal(got[i], want), (gemms, m, gemm)
    # a unit the plan leaves on the low-cost path ignores the subset
    kept, _ = run_linear(low, rec, ["fprop"], set())
    for a, b in zip(kept, all_low, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_stochastic_rounding_draws_are_each_paths_own():
    """The NVFP4 comparison above is not vacuous: another step draws other bits on both paths,
    so the subset's GEMMs matched only because each drew with its own path's seed."""
    low, rec = NVFP4
    for plan in (set(), {0}):
        a, _ = run_linear(low, rec, None, plan)
        b, _ = run_linear(low, rec, None, plan, step=STEP + 1)
        assert torch.equal(a[0][0], b[0][0])  # fprop rounds to nearest
        assert not torch.equal(a[0][1], b[0][1]) and not torch.equal(a[0][2], b[0][2])


@pytest.mark.parametrize("paths", [FP8, NVFP4], ids=["fp8_e4m3_tensor", "nvfp4"])
def test_the_default_is_the_whole_recovery_path_of_before(paths):
    """No key, ``None`` and all three GEMMs are one backend; a recovered GEMM is the recovery
    spec's own call with the seed of its key (step, unit, operator, call, not measuring)."""
    low, rec = paths
    default, _ = run_linear(low, rec, None, {0})
    listed, _ = run_linear(low, rec, ["wgrad", "dgrad", "fprop"], {0})
    spec = get_backend("fp8_emulated", low_cost=low, recovery=rec).specs["recovery"]
    lin = nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(_rand(48, 64, seed=1) / 8)
        lin.bias.copy_(_rand(48, seed=2))
    for m in range(MICRO):
        x = _rand(2, 16, 64, seed=10 + m).requires_grad_()
        call = EmulatedCall(spec, seed=sr_seed(spec.seed, STEP, 0, 0, m, 0))
        y = call(x, lin.weight, lin.bias)
        y.backward(_rand(2, 16, 48, seed=20 + m))
        for got in (default[m], listed[m]):
            assert torch.equal(got[0], y.detach()) and torch.equal(got[1], x.grad)
            assert torch.equal(got[2], lin.weight.grad)
        lin.weight.grad = None
    assert get_backend("fp8_emulated").gemms == ALL_GEMMS


@pytest.mark.parametrize("paths", [FP8, NVFP4], ids=["fp8_e4m3_tensor", "nvfp4"])
def test_the_error_score_is_the_low_cost_wgrad_bound_whatever_the_subset(paths):
    """``B(u)`` bounds the low-cost wgrad error: measured by the real GEMM when wgrad stays
    low-cost, in shadow when it is recovered; the same number as the unrecovered unit's."""
    low, rec = paths
    _, want = run_linear(low, rec, None, set(), track=True)
    assert float(want[0]) > 0
    for gemms in SUBSETS:
        _, got = run_linear(low, rec, gemms, {0}, track=True)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=str(gemms))


# ---------------------------------------------------------------------- the block and refusals


@pytest.mark.parametrize(
    "value, message",
    [
        ("fprop", r"gnmr\.gemms must be a list of GEMM names, got the string 'fprop'; write "),
        ({"fprop": 1}, r"gnmr\.gemms must be a non-empty list of GEMM names .*\(dict\)"),
        (None, r"gnmr\.gemms must be a non-empty list .*got None \(NoneType\)"),
        ([], r"gnmr\.gemms must name at least one GEMM .*drop gnmr\.gemms to recover all three"),
        (["fprop", "wgard"], r"gnmr\.gemms: unknown GEMM 'wgard'; did you mean 'wgrad'\?"),
        (["fprop", 2], r"gnmr\.gemms: unknown GEMM 2 \(allowed: 'fprop', 'dgrad', 'wgrad'\)"),
        (["dgrad", "fprop", "dgrad"], r"gnmr\.gemms names 'dgrad' twice in \['dgrad', 'f"),
    ],
)
def test_block_errors_name_the_key_the_value_and_the_allowed_names(value, message):
    with pytest.raises(ValueError, match=message):
        GNMRBlock.from_dict({"backend": "fp8_emulated", "gemms": value})


def test_block_default_order_and_the_keys_that_need_another():
    assert GNMRBlock.from_dict({"backend": "fp8_emulated"}).gemms == GEMMS
    block = GNMRBlock.from_dict({"backend": "fp8_emulated", "gemms": ["wgrad", "fprop"]})
    assert block.gemms == ("fprop", "wgrad") and block.build_backend().gemms == {"fprop", "wgrad"}
    assert parse_gemms(("dgrad",)) == ("dgrad",)
    with pytest.raises(ValueError, match=r"unknown key gnmr\.gemm; did you mean 'gemms'\?"):
        GNMRBlock.from_dict({"backend": "fp8_emulated", "gemm": ["fprop"]})
    with pytest.raises(ValueError, match=r"gnmr\.gemms=\['fprop'\] needs a precision backend"):
        GNMRBlock.from_dict({"backend": None, "gemms": ["fprop"]})
    with pytest.raises(ValueError, match=r"gnmr\.gamma scores the damage term e.*add 'wgrad'"):
        GNMRBlock.from_dict({"backend": "fp8_emulated", "gemms": ["fprop"], "gamma": 0.5})
    ok = GNMRBlock.from_dict({"backend": "fp8_emulated", "gemms": ["wgrad"], "gamma": 0.5})
    assert ok.policy.gamma is not None


@pytest.mark.parametrize(
    "block, message",
    [
        (
            {"backend": "int8", "gemms": ["fprop"]},
            r"gnmr\.gemms \['fprop'\]: the 'int8' backend cannot recover only these GEMMs: its "
            r"low-cost path is one W8A8",
        ),
        (
            {"backend": "act_quant", "gemms": ["fprop", "dgrad"]},
            r"the 'act_quant' backend cannot .*without 'wgrad' a recovered unit would run "
            r"exactly the low-cost path\. Add 'wgrad'",
        ),
        (
            {
                "backend": "fp8_emulated",
                "gemms": ["fprop"],
                "low_cost": {"format": "e4m3", "granularity": "tensor", "scaling": "delayed"},
            },
            r"the 'fp8_emulated' backend .*gnmr\.low_cost uses delayed scaling.*Use \"scaling\": "
            r"\"current\"",
        ),
    ],
)
def test_a_backend_that_cannot_run_a_subset_refuses_it_when_built(block, message):
    parsed = GNMRBlock.from_dict(block)  # the block itself is well formed
    with pytest.raises(ValueError, match=message):
        parsed.build_backend()


def test_an_own_backend_refuses_subsets_and_the_subset_is_set_before_wrap():
    class Plain(PrecisionBackend):
        name = "plain"

    with pytest.raises(ValueError, match=r"\['wgrad'\]: the 'plain' backend cannot recover"):
        Plain().set_gemms(["wgrad"])
    Plain().set_gemms(list(GEMMS))
    backend = get_backend("fp8_emulated")
    backend.wrap({0: nn.Linear(4, 4)})
    with pytest.raises(RuntimeError, match="set_gemms must be called before wrap"):
        backend.set_gemms(["fprop"])


def test_act_quant_subsets_with_wgrad_are_exactly_the_recovery_path():
    """Only wgrad reads the saved x: fprop and dgrad are exact on both paths, so every subset
    holding wgrad computes what all three do, bit for bit."""

    def run(gemms):
        lin = nn.Linear(64, 32)
        with torch.no_grad():
            lin.weight.copy_(_rand(32, 64, seed=3))
            lin.bias.copy_(_rand(32, seed=6))
        backend = get_backend("act_quant", low_cost={"bits": 2, "group_size": 32}, gemms=gemms)
        backend.wrap({0: lin})
        backend.apply({0}, step=1)
        x = _rand(8, 64, seed=4).requires_grad_()
        y = lin(x)
        y.backward(_rand(8, 32, seed=5))
        return y.detach(), x.grad, lin.weight.grad

    want = run(None)
    for gemms in (s for s in SUBSETS if "wgrad" in s):
        assert all(torch.equal(a, b) for a, b in zip(run(gemms), want, strict=True)), gemms


# ---------------------------------------------------------------------- te_fp8's routes (CPU)

ALL = TEFeatures(backward_override=True, hybrid=True, non_tn_fp8=True)
HOPPER = TEFeatures(backward_override=True, hybrid=True, non_tn_fp8=False)
TE_2_15 = TEFeatures(backward_override=True, hybrid=False, non_tn_fp8=False)


def test_te_route_per_subset():
    fs = frozenset
    assert choose_route("delayed", "bf16", ALL_GEMMS, TE_2_15) == REGIONS
    assert choose_route("tensorwise", "bf16", fs({"dgrad", "wgrad"}), TE_2_15) == OVERRIDE
    assert choose_route("nvfp4", "bf16", fs({"dgrad", "wgrad"}), ALL) == OVERRIDE
    assert choose_route("tensorwise", "mxfp8", fs({"dgrad", "wgrad"}), ALL) == CUSTOM
    for gemms in (fs(s) for s in SUBSETS if len(s) < 3 and s != ["dgrad", "wgrad"]):
        assert choose_route("blockwise", "bf16", gemms, HOPPER) == CUSTOM
        assert choose_route("tensorwise", "bf16", gemms, ALL) == CUSTOM
        with pytest.raises(ValueError, match=r"TE >= 2\.19\).*TE >= 2\.15 runs only"):
            choose_route("blockwise", "bf16", gemms, TE_2_15)
        with pytest.raises(ValueError, match=r"DelayedScaling takes no backward_override"):
            choose_route("delayed", "bf16", gemms, ALL)
    # Hopper: a per-tensor FP8 quantizer may not write a columnwise layout alone
    assert choose_route("tensorwise", "bf16", fs({"wgrad"}), HOPPER) == CUSTOM
    for gemms in (["fprop"], ["dgrad"], ["fprop", "dgrad"], ["fprop", "wgrad"]):
        with pytest.raises(ValueError, match=r"columnwise layout of \[.*issue #3158"):
            choose_route("tensorwise", "bf16", fs(gemms), HOPPER)


def test_te_subset_factory_gives_each_layout_its_gemms_path():
    """fprop = weight.row x input.row, dgrad = weight.col x grad_output.row, wgrad = input.col
    x grad_output.col: each layout gets the quantizer of its GEMM's path."""

    def make(path, role):
        return (path, getattr(role, "tensor_type", None))

    def hybrid(row, col):
        return ("hybrid", row, col)

    def role(tensor):
        return SimpleNamespace(tensor_type=tensor)

    q = subset_qfactory(frozenset({"fprop"}), make, hybrid)
    assert q(role("input")) == ("hybrid", ("recovery", "input"), ("low_cost", "input"))
    assert q(role("weight")) == ("hybrid", ("recovery", "weight"), ("low_cost", "weight"))
    assert q(role("grad_output")) == ("low_cost", "grad_output")
    assert q(role("output")) == ("recovery", "output") and q(None) == ("recovery", None)
    q = subset_qfactory(frozenset({"dgrad"}), make, hybrid)
    assert q(role("input")) == ("low_cost", "input")
    assert q(role("weight")) == ("hybrid", ("low_cost", "weight"), ("recovery", "weight"))
    want = ("hybrid", ("recovery", "grad_output"), ("low_cost", "grad_output"))
    assert q(role("grad_output")) == want
    assert q(role("grad_input")) == ("recovery", "grad_input")
    assert split_layouts({"wgrad"}) == {
        "input": ("low_cost", "recovery"),
        "grad_output": ("low_cost", "recovery"),
    }
    assert split_layouts(GEMMS) == {} and split_layouts(()) == {}


@pytest.fixture
def te_stand_in(monkeypatch):
    """te_stand_ins' stand-in TE, plus the pieces the subset routes look up: recipes with
    ``backward_override``, ``CustomRecipe``, ``RecipeState``, the hybrid and identity
    quantizers, and ``is_non_tn_fp8_gemm_supported`` (a Blackwell here)."""
    from tests.backends.te_stand_ins import build_fake_te

    def install(hybrid=True):
        modules, rec = build_fake_te()
        recipe = modules["transformer_engine.common.recipe"]
        for cls in ("Float8CurrentScaling", "Float8BlockScaling", "NVFP4BlockScaling"):
            getattr(recipe, cls).backward_override = None
        extra = {}
        if hybrid:
            recipe.CustomRecipe = type(
                "CustomRecipe", (), {"__init__": lambda self, **kw: setattr(self, "kwargs", kw)}
            )
            quantization = types.ModuleType("transformer_engine.pytorch.quantization")
            quantization.RecipeState = SimpleNamespace(
                create=lambda r, mode, num_quantizers, roles: SimpleNamespace(
                    make_quantizers=lambda: [(type(r).__name__, mode, roles[0].tensor_type)]
                )
            )
            hybrid_mod = types.ModuleType("transformer_engine.pytorch.tensor.hybrid_tensor")
            hybrid_mod.HybridQuantizer = lambda rowwise_quantizer, columnwise_quantizer: (
                "hybrid",
                rowwise_quantizer,
                columnwise_quantizer,
            )
            identity = types.ModuleType("transformer_engine.pytorch.tensor.identity_tensor")
            identity.IdentityQuantizer = lambda: "identity"
            utils = types.ModuleType("transformer_engine.pytorch.utils")
            utils.is_non_tn_fp8_gemm_supported = lambda: True
            extra = {
                m.__name__: m
                for m in (
                    quantization,
                    hybrid_mod,
                    identity,
                    utils,
                    types.ModuleType("transformer_engine.pytorch.tensor"),
                )
            }
        for name, module in {**modules, **extra}.items():
            monkeypatch.setitem(sys.modules, name, module)
        rec.te, rec.recipe = modules["transformer_engine.pytorch"], recipe
        return rec

    return install


def _recovered_forward(backend, rec):
    layer = rec.te.Linear(8, 8)
    backend.wrap({0: layer})
    backend.apply({0}, step=1)
    with backend.autocast():
        layer(torch.ones(2, 8))
    return layer.seen[-1]


def test_te_fp8_dgrad_wgrad_in_bf16_is_the_low_cost_recipe_with_backward_override(te_stand_in):
    from gnmr_dist.backends.te_fp8 import TEFp8Backend

    rec = te_stand_in(hybrid=False)
    backend = TEFp8Backend(low_cost={"recipe": "tensorwise"})
    backend.set_gemms(["dgrad", "wgrad"])
    assert backend.route == OVERRIDE
    outer, inner = _recovered_forward(backend, rec)
    assert outer == (True, backend.low_cost_recipe, None)
    assert inner[0] is True and inner[1] is backend.subset_recipe
    assert type(inner[1]).__name__ == "Float8CurrentScaling"
    assert inner[1].kwargs == {
        **backend.low_cost_recipe.kwargs,
        "backward_override": "high_precision",
    }
    with pytest.raises(ValueError, match=r"TE >= 2\.19"):
        TEFp8Backend(low_cost={"recipe": "tensorwise"}).set_gemms(["fprop"])
    with pytest.raises(ValueError, match="DelayedScaling takes no backward_override"):
        TEFp8Backend(low_cost={"recipe": "delayed"}).set_gemms(["dgrad", "wgrad"])
    mlp = TEFp8Backend(low_cost={"recipe": "tensorwise"})
    mlp.set_gemms(["dgrad", "wgrad"])
    with pytest.raises(ValueError, match=r"unit 0 holds a LayerNormMLP"):
        mlp.wrap({0: nn.Sequential(rec.te.LayerNormMLP(8, 8))})
    assert mlp.units == frozenset()


def test_te_fp8_other_subsets_run_a_custom_recipe_of_per_layout_quantizers(te_stand_in):
    from gnmr_dist.backends.te_fp8 import TEFp8Backend

    rec = te_stand_in()
    backend = TEFp8Backend(low_cost={"recipe": "blockwise"})
    backend.set_gemms(["fprop"])
    assert backend.route == CUSTOM
    _, inner = _recovered_forward(backend, rec)
    custom = inner[1]
    assert inner[0] is True and type(custom).__name__ == "CustomRecipe"
    q = custom.kwargs["qfactory"]
    low = ("Float8BlockScaling", "forward", "input")
    assert q(SimpleNamespace(tensor_type="input")) == ("hybrid", "identity", low)
    grad = ("Float8BlockScaling", "backward", "grad_output")
    assert q(SimpleNamespace(tensor_type="grad_output")) == grad
    stronger = TEFp8Backend(low_cost={"recipe": "tensorwise"}, recovery={"recipe": "mxfp8"})
    stronger.set_gemms(["dgrad", "wgrad"])
    q = stronger.subset_recipe.kwargs["qfactory"]
    assert stronger.route == CUSTOM
    assert q(SimpleNamespace(tensor_type="grad_output")) == (
        "MXFP8BlockScaling",
        "backward",
        "grad_output",
    )


# ---------------------------------------------------------------------- te_fp8 on a GPU

GPU_SIZE = 256


def _te_run(te, module, region, x, dy):
    """``(y, dx, dW)`` of one forward and backward of ``module`` inside ``region()``."""
    module.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    with region():
        y = module(xi)
    y.backward(dy)
    return y.detach(), xi.grad, module.weight.grad.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("gemms", SUBSETS, ids="+".join)
def test_te_fp8_subset_routes_against_plain_transformer_engine(gemms):
    """A blockwise low-cost ``te.Linear`` recovered with each subset: the recovered GEMMs give
    the BF16 module's results, the others plain TE blockwise FP8's, bit for bit (a subset the
    installed TE has no route for is skipped with the reason)."""
    import contextlib

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.gpu.te_guard import require_cuda_and_te

    te, te_recipe = require_cuda_and_te()
    from gnmr_dist.backends.te_fp8 import TEFp8Backend

    try:
        backend = TEFp8Backend(low_cost={"recipe": "blockwise"})
        backend.set_gemms(gemms)
    except (ImportError, RuntimeError, ValueError) as err:
        pytest.skip(str(err))
    torch.manual_seed(0)
    lin = te.Linear(GPU_SIZE, GPU_SIZE, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4 * GPU_SIZE, GPU_SIZE, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn_like(x)

    def fp8_region():
        recipe = te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.HYBRID)
        if hasattr(te, "autocast"):
            return te.autocast(enabled=True, recipe=recipe)
        return te.fp8_autocast(enabled=True, fp8_recipe=recipe)

    fp8 = _te_run(te, lin, fp8_region, x, dy)
    bf16 = _te_run(te, lin, contextlib.nullcontext, x, dy)
    backend.wrap({0: lin})
    backend.apply({0}, step=1)
    got = _te_run(te, lin, backend.autocast, x, dy)
    backend.unwrap()
    for i, gemm in enumerate(GEMMS):
        want = (bf16 if gemm in gemms else fp8)[i]
        assert torch.equal(got[i], want), (gemms, gemm, backend.route)
    assert all(not torch.equal(a, b) for a, b in zip(fp8, bf16, strict=True))


# ---------------------------------------------------------------------- DeepSpeed and megatron

LOW_E4M3, REC_BF16 = {"format": "e4m3", "granularity": "tensor"}, {"format": "bf16"}


def _composition(x, w, dy, *, group=None):
    """What a unit recovered by ``["fprop"]`` must compute from its GEMM's operands: ``y`` on
    the recovery spec, ``dx`` and ``dW`` on the low-cost spec (``dx`` summed over ``group``, as
    a column-parallel linear's all-reduce does), and the other path's for contrast."""
    import torch.distributed as dist

    specs = get_backend("fp8_emulated", low_cost=LOW_E4M3, recovery=REC_BF16).specs
    out = {}
    for path in ("low_cost", "recovery"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = EmulatedCall(specs[path])(xi, wi, None)
        y.backward(dy)
        dx = xi.grad
        if group is not None:
            dist.all_reduce(dx, group=group)
        out[path] = (y.detach(), dx, wi.grad)
    return out


def _check_fprop_only(seen, dx, dw, *, group=None) -> dict:
    """Per GEMM: equal to the path the subset gives it, and different from the other path."""
    ref = _composition(seen["x"], seen["w"], seen["dy"], group=group)
    low, rec = ref["low_cost"], ref["recovery"]
    return {
        "y": torch.equal(seen["y"], rec[0]) and not torch.equal(seen["y"], low[0]),
        "dx": torch.equal(dx, low[1]) and not torch.equal(dx, rec[1]),
        "dW": torch.equal(dw, low[2]) and not torch.equal(dw, rec[2]),
    }


def _ds_worker(rank, world):
    import gnmr_dist.deepspeed as gds
    from tests.integrations.deepspeed import common as dsc

    dsc.no_shm_build()
    block = {
        "backend": "fp8_emulated",
        "low_cost": LOW_E4M3,
        "recovery": REC_BF16,
        "gemms": ["fprop"],
        "include": ["*.mlp.down_proj"],
        "max_active": 2,
        "warmup_steps": 0,
        "alpha": 1e-6,
        "beta": 1e-6,
    }
    engine, *_ = gds.initialize(model=dsc.llama(), config=dsc.ds_config(2, "fp32", block))
    target = engine.module.model.layers[1].mlp.down_proj
    seen: dict = {}

    def forward_hook(module, inputs, output):
        x = inputs[0]
        seen.update(x=x.detach().clone(), w=module.weight.detach().clone(), y=output.detach())
        x.register_hook(lambda g: seen.__setitem__("dx", g.clone()))
        output.register_hook(lambda g: seen.__setitem__("dy", g.clone()))

    target.register_forward_hook(forward_hook)
    target.weight.register_hook(lambda g: seen.__setitem__("dW", g.clone()))
    unit = engine.gnmr.registry.names.index("model.layers.1.mlp.down_proj")
    out = []
    for step in (1, 2):
        tokens = dsc.batch(step, rank)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        ran = engine.gnmr.last_report
        checks = _check_fprop_only(seen, seen["dx"], seen["dW"])
        out.append((unit in ran.recovered, unit in ran.low_cost, checks, seen["y"]))
    return engine.gnmr.backend.gemms, out


@pytest.mark.slow
def test_deepspeed_zero2_fprop_only_recovery_composes_the_two_paths():
    """ZeRO-2, 2 gloo ranks, the down projections as units, every unit selected after step 1:
    at step 2 layer 1's down projection runs fprop on BF16 inputs and dgrad, wgrad on e4m3,
    bit for bit the composition computed from the operands it saw (at step 1 it was low-cost
    throughout); both ranks ran the same plan."""
    from tests.requires import require

    require("deepspeed")
    from tests import multiproc

    results = multiproc.run(_ds_worker, 2)
    for gemms, (first, second) in results:
        assert gemms == {"fprop"}
        assert first[:2] == (False, True)
        assert not first[2]["y"] and first[2]["dx"] and first[2]["dW"]  # low-cost y at step 1
        assert second[:2] == (True, False) and second[2] == {"y": True, "dx": True, "dW": True}
    assert results[0][1][1][:2] == results[1][1][1][:2]


def _megatron_worker(rank, world):
    import torch.distributed as dist

    from gnmr_dist.distributed import UnitRegistry
    from gnmr_dist.integrations.megatron.operators import MEGATRON_MARKS as MARKS
    from gnmr_dist.integrations.megatron.operators import MEGATRON_OPERATORS as OPS
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import gpt

    enable_cpu_compat()
    full, _ = gpt.full_reference(1)
    model = gpt.parallel_model(2, 1, full)
    reg = UnitRegistry.from_model(
        model, group=dist.group.WORLD, operator_types=OPS.all_types(), marks=MARKS
    )
    block = GNMRBlock.from_dict(
        {"backend": "fp8_emulated", "low_cost": LOW_E4M3, "recovery": REC_BF16, "gemms": ["fprop"]}
    )
    backend = block.build_backend(OPS)
    backend.wrap(reg.local_modules)
    uid = next(i for i, n in enumerate(reg.names) if n.endswith("layers.1.mlp.linear_fc1"))
    target = reg.local_modules[uid]
    records, dws = [], []
    installed = target._forward_impl

    def recording(input, weight, bias=None, *args, **kwargs):  # the GEMM's own operands
        out = installed(input, weight, bias, *args, **kwargs)
        seen = {"x": input.detach().clone(), "w": weight.detach().clone(), "y": out.detach()}
        input.register_hook(lambda g: seen.__setitem__("dx", g.clone()))
        out.register_hook(lambda g: seen.__setitem__("dy", g.clone()))
        records.append(seen)
        return out

    target._forward_impl = recording
    target.weight.register_hook(lambda g: dws.append(g.clone()))
    backend.apply({uid}, step=1)
    gpt.train_step(model)
    report = backend.report()
    checks = [
        _check_fprop_only(seen, seen["dx"], dw, group=dist.group.WORLD)
        for seen, dw in zip(records, dws, strict=True)
    ]
    return reg.names[uid], report.recovered, len(records), checks, type(target).__name__


@pytest.mark.slow
def test_megatron_tp2_fprop_only_recovery_composes_the_two_paths():
    """TP2 (gloo, CPU), megatron's own ColumnParallelLinear as the recovered unit, built from a
    block with ``"gemms": ["fprop"]``: for each micro-batch its local GEMM's output is the BF16
    path's on the operands it saw, its weight gradient and its input gradient (all-reduced over
    the tensor-parallel group, as megatron's copy-to-region does) the e4m3 path's."""
    from tests.requires import require

    require("megatron.core")
    from tests import multiproc
    from tests.integrations.megatron import gpt

    (results,) = multiproc.run_jobs([(_megatron_worker, 2, ())], preload=("megatron_patches",))
    for name, recovered, calls, checks, kind in results:
        assert name.endswith("layers.1.mlp.linear_fc1") and kind == "ColumnParallelLinear"
        assert len(recovered) == 1 and calls == gpt.NUM_MICRO
        assert checks == [{"y": True, "dx": True, "dW": True}] * gpt.NUM_MICRO
