"""``gnmr.gemms``: a recovered unit recovers a subset of its GEMMs (fprop, dgrad, wgrad).

For ``fp8_emulated`` (FP8 e4m3 per tensor, and NVFP4 with stochastic rounding on both paths)
every non-empty subset is run against two reference runs of the same step and seeds, all units
recovered and none: each GEMM in the subset must give bit for bit the recovered run's result
(``y`` for fprop, ``dx`` for dgrad, ``dW`` for wgrad), each GEMM outside it the low-cost run's.
The default must be today's recovery path, the block's errors name key, value and allowed
names, and the backends that cannot run a subset refuse it when built (``te_fp8``'s routes
are in ``test_gemm_subset_te.py``). DeepSpeed ZeRO-2 (2 ranks)
and megatron-core TP2 (gloo, CPU) runs of an fprop-only subset are marked ``slow``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from gnmr_dist.backends import PrecisionBackend, get_backend
from gnmr_dist.backends.emulated_linear import EmulatedCall
from gnmr_dist.backends.gemms import ALL_GEMMS, GEMMS, parse_gemms
from gnmr_dist.backends.numerics.rounding import sr_seed
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
