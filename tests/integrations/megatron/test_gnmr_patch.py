"""megatron_patches.enable: per-unit norms ride megatron's clip-norm all-reduce (TP2, PP2)."""

from __future__ import annotations

import pytest
import torch

from tests.requires import require

require("megatron.core")

from tests import multiproc

pytestmark = pytest.mark.slow


SPIKE_STEP, SPIKE_UNIT = 3, "decoder.layers.3.mlp.linear_fc1"
"""The reduced gradient of one unit (on the last pipeline stage) is scaled x100 at this step, in
both runs (GNMR off and on), so the controller selects it and the next steps run a plan."""


def _spike(model) -> None:
    from gnmr_dist.distributed.units import global_param_names
    from gnmr_dist.integrations.megatron.operators import MEGATRON_MARKS

    names = global_param_names(model, marks=MEGATRON_MARKS)
    for local, param in model.named_parameters():
        if names[local].startswith(SPIKE_UNIT + "."):
            param.main_grad.mul_(100.0)


def _run(model, opt, steps, handle=None):
    """Train ``steps`` steps; with a backend, what each step's forwards ran (its report)."""
    from tests.integrations.megatron import gpt

    calls, norms, reports = [], [], []
    for step in range(1, steps + 1):
        with multiproc.CollectiveSpy() as spy:
            gpt.train_step(model, step)
            if step == SPIKE_STEP:
                _spike(model)
            if handle is not None and handle.backend is not None:
                r = handle.backend.report()  # the plan this step ran (settled before its forward)
                d = handle.runtime.last_decision  # the decision that plan came from
                decided = (d.step, set(d.active)) if d is not None else (0, set())
                reports.append((r.step, set(r.planned), set(r.recovered), decided))
            ok, grad_norm, _ = opt.step()
        assert ok
        calls.append(spy.calls)
        norms.append(grad_norm)
    return calls, norms, reports


def _worker(rank, world, tp, pp, steps, backend):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer

    import megatron_patches
    from gnmr_dist.distributed import GradNormMonitor
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import gpt

    enable_cpu_compat()
    full, _ = gpt.full_reference(world // (tp * pp))
    cfg = OptimizerConfig(optimizer="sgd", lr=0.05, clip_grad=0.5)

    plain = gpt.parallel_model(tp, pp, full)
    off_calls, off_norms, _ = _run(plain, get_megatron_optimizer(cfg, [plain]), steps)
    ps.destroy_model_parallel()

    model = gpt.parallel_model(tp, pp, full)
    opt = get_megatron_optimizer(cfg, [model])
    original_norm_fn = mcore_optimizer.get_grad_norm_fp32
    block = {"backend": backend, "max_active": 2, "warmup_steps": 2, "lock_steps": 2}
    handle = megatron_patches.enable(model, block, optimizer=opt)
    assert megatron_patches.enable(model, block, optimizer=opt) is handle  # idempotent
    on_calls, on_norms, reports = _run(model, opt, steps, handle)
    # the fused per-unit norms equal GNMR's own monitor on the same gradients
    gpt.train_step(model, steps + 1)
    own = GradNormMonitor(handle.registry, group=ps.get_model_parallel_group()).compute()
    opt.step()
    handle.settle()  # the decision is taken lazily, when the next step first needs the plan
    fused = handle.runtime.last_norms
    local = set(handle.backend.units) if handle.backend is not None else None  # wrapped here
    megatron_patches.disable()
    restored = (
        mcore_optimizer.get_grad_norm_fp32 is original_norm_fn
        and "step" not in vars(opt)
        and megatron_patches.current() is None
    )
    return {
        "off": (off_calls, off_norms),
        "on": (on_calls, on_norms),
        "own": own,
        "fused": fused,
        "units": handle.registry.num_units,
        "restored": restored,
        "risk": handle.last_decision.risk,
        "reports": reports,
        "local": local,
        "spiked": handle.registry.names.index(SPIKE_UNIT),
    }


@pytest.mark.parametrize(
    "world, tp, pp, backend",
    [(2, 2, 1, None), (2, 1, 2, "fp8_emulated")],
    ids=["tp2-observe", "pp2-fp8_emulated"],
)
def test_unit_norms_ride_the_clip_norm_all_reduce(world, tp, pp, backend):
    results = multiproc.run(_worker, world, tp, pp, 6, backend)
    for r in results:
        (off_calls, off_norms), (on_calls, on_norms) = r["off"], r["on"]
        u = r["units"]
        for off, on in zip(off_calls, on_calls, strict=True):
            assert [name for name, _ in on] == [name for name, _ in off]  # same collectives
            changed = [(a, b) for a, b in zip(off, on, strict=True) if a != b]
            assert changed == [(("all_reduce", 1), ("all_reduce", u + 3))]  # only the clip norm
        if backend is None:  # same trajectory: the clip norm megatron sees is unchanged
            assert on_norms == pytest.approx(off_norms, rel=1e-6)
        assert torch.allclose(r["fused"].norms, r["own"].norms, rtol=1e-5, atol=0)
        assert r["fused"].global_norm == pytest.approx(r["own"].global_norm, rel=1e-5)
        assert r["restored"]
        assert torch.equal(r["risk"], results[0]["risk"])  # every rank decided the same
    if backend is None:
        return
    # every step ran the plan decided at the step before: each rank recovered exactly the
    # planned units it holds (pipeline stages hold different units), together all of them
    assert [step for step, *_ in results[0]["reports"]] == list(range(1, 7))
    planned = [p for _, p, _, _ in results[0]["reports"]]
    for r in results:
        assert [q for _, q, _, _ in r["reports"]] == planned
        assert [d for *_, d in r["reports"]] == [(t, p) for t, p in enumerate(planned)]
    spiked = results[0]["spiked"]
    assert not any(spiked in p for p in planned[:SPIKE_STEP])
    assert spiked in planned[SPIKE_STEP]  # selected at the spike, run at the next step
    for step, p in enumerate(planned, start=1):
        for r in results:
            assert r["reports"][step - 1][2] == p & r["local"], (step, r["local"])
        assert set().union(*(r["reports"][step - 1][2] for r in results)) == p, step
    assert all(r["local"] for r in results) and not (results[0]["local"] & results[1]["local"])


def test_unsupported_version_is_named(monkeypatch):
    from megatron.core import package_info

    import megatron_patches

    monkeypatch.setattr(package_info, "__version__", "0.21.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.21 is not in the version table"):
        megatron_patches.enable(torch.nn.Linear(2, 2), {"max_active": 1})


def _fp8_context_worker(rank, world):
    import contextlib

    from megatron.core.transformer import transformer_block

    import megatron_patches
    from gnmr_dist.backends import PrecisionBackend
    from gnmr_dist.distributed import Plan
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import gpt

    class RecoveryRegion(PrecisionBackend):  # stand-in for te_fp8's region (TE cannot run here)
        def recovery_region(self):
            return contextlib.nullcontext("recovery")

    enable_cpu_compat()
    full, _ = gpt.full_reference(1)
    model = gpt.parallel_model(1, 1, full)
    original = transformer_block.get_fp8_context
    original_fp4 = transformer_block.get_fp4_context
    handle = megatron_patches.enable(model, {"units": "layer", "max_active": 2})
    handle.backend = RecoveryRegion()
    names = handle.registry.names
    handle.runtime.plan = Plan(
        step=5, active=frozenset({names.index("decoder.layers.2")}), names=("decoder.layers.2",)
    )
    cfg = model.config
    got, init = {}, {}
    for name in ("get_fp8_context", "get_fp4_context"):  # megatron's FP8 and FP4 runs alike
        context = getattr(transformer_block, name)
        got[name] = {n: context(cfg, n).__enter__() for n in range(-1, 4)}
        init[name] = context(cfg, 2, is_init=True).__enter__()
    megatron_patches.disable()
    restored = transformer_block.get_fp8_context is original and (
        transformer_block.get_fp4_context is original_fp4
    )
    model.config.fp4 = "e2m1"  # megatron's --fp4-format e2m1, on a machine without FP4 GEMMs
    try:
        megatron_patches.enable(model, {"max_active": 1})
        refusal = None
    except RuntimeError as err:
        refusal = str(err)
    return names, got, init, restored, refusal


def test_per_layer_context_follows_the_plan_by_global_layer():
    """FP8 and FP4 contexts follow the plan; an FP4 config is refused here, naming the device."""
    names, got, init, restored, refusal = multiproc.run(_fp8_context_worker, 1)[0]
    assert names == tuple(f"decoder.layers.{i}" for i in range(4))
    for name in ("get_fp8_context", "get_fp4_context"):
        assert got[name] == {-1: None, 0: None, 1: None, 2: "recovery", 3: None}, name
        assert init[name] is None
    assert restored
    assert refusal is not None and "--fp4-format e2m1" in refusal
    assert "no CUDA device: it runs on the CPU" in refusal


def _rerun_worker(rank, world):
    from megatron.core import rerun_state_machine

    import megatron_patches
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import gpt

    enable_cpu_compat()
    full, _ = gpt.full_reference(1)
    model = gpt.parallel_model(1, 1, full)
    handle = megatron_patches.enable(model, {"backend": "fp8_emulated", "units": "layer"})
    rsm = rerun_state_machine.get_rerun_state_machine()
    calls = []
    rsm.state_save_func = lambda: calls.append("save") or {"megatron": 1}
    rsm.state_restore_func = lambda state: calls.append(("restore", state))
    handle.install_rerun_hooks()
    handle.backend.apply({1}, step=7)  # the plan of the iteration being validated
    snapshot = rsm.state_save_func()
    handle.backend.apply({3}, step=8)  # whatever changed it before the rerun
    rsm.state_restore_func(snapshot)
    recovered_after_restore = set(handle.backend.report().planned)
    megatron_patches.disable()
    return recovered_after_restore, calls


def test_rerun_replays_the_plan_and_chains_megatrons_hooks():
    plan, calls = multiproc.run(_rerun_worker, 1)[0]
    assert plan == {1}
    assert calls == ["save", ("restore", {"megatron": 1})]


def _guard_worker(rank, world, breakage, action):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import megatron_patches
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import gpt

    enable_cpu_compat()
    full, _ = gpt.full_reference(1)
    model = gpt.parallel_model(1, 1, full)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.05, clip_grad=1.0), [model])
    block = {"max_active": 2, "attribution": {"action": action}}
    handle = megatron_patches.enable(model, block, optimizer=opt)
    rest = handle.registry.num_units
    if breakage == "rest":  # the old bug: every gradient missed, so it lands in the rest slot
        handle.attribution.slots = lambda grads: [rest] * len(grads)
    elif breakage == "unattributed":  # main parameters the optimizer structures do not pair
        handle.attribution._mains = [(main, rest + 1) for main, _ in handle.attribution._mains]
    errors = []
    for step in range(1, 4):
        gpt.train_step(model, step)
        try:
            opt.step()
            handle.settle()
        except RuntimeError as err:
            errors.append(str(err))
            break
    steps = handle.controller.step_count
    megatron_patches.disable()
    return errors, steps


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("rest", "the units received no gradient while the total norm is"),
        ("unattributed", "100.0% of the squared gradient norm megatron's clip norm reads"),
    ],
)
def test_attribution_guard_fires_on_a_broken_mapping(breakage, message, caplog):
    from gnmr_dist.integrations.megatron.versions import megatron_series

    errors, steps = multiproc.run(_guard_worker, 1, breakage, "error")[0]
    series = f"at step 1 (megatron-core {megatron_series()}.x"  # the venv's release
    assert len(errors) == 1 and message in errors[0] and series in errors[0]
    assert "optimizer ['FP32Optimizer'], use_distributed_optimizer=False" in errors[0]
    assert "gnmr.attribution.action='warn'" in errors[0] and steps == 0


def test_attribution_guard_can_warn_once_instead():
    errors, steps = multiproc.run(_guard_worker, 1, "rest", "warn")[0]
    assert errors == [] and steps == 3
    errors, steps = multiproc.run(_guard_worker, 1, None, "error")[0]
    assert errors == [] and steps == 3  # the real mapping passes the guard every step


def _paths_worker(rank, world, arm):
    """One step of the distributed optimizer (DP2, fp32) under one of GNMR's three norm paths."""
    import warnings

    from megatron.core import parallel_state as ps

    import megatron_patches
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import settings

    warnings.filterwarnings("ignore")
    enable_cpu_compat()
    with settings.full_layout():
        full = settings.full_model()
    if arm == "no-clip":
        settings.CLIP_GRAD = 0.0  # megatron then computes no norm in a plain optimizer's step
    chunks, chained = settings.build(settings.SETTINGS_BY_NAME["distopt-fp32-dp2"], full)
    opt = chained.chained_optimizers[0] if arm == "no-clip" else chained
    fused = arm != "unfused"
    handle = megatron_patches.enable(chunks, {"max_active": 1}, optimizer=opt, fused_norm=fused)
    settings.train_step(chunks, 0)
    with multiproc.CollectiveSpy() as spy:
        _, megatron_norm, _ = opt.step()
    handle.settle()
    norms = handle.runtime.last_norms
    megatron_patches.disable()
    ps.destroy_model_parallel()
    return (
        norms.norms.tolist(),
        norms.global_norm,
        float(megatron_norm),
        spy.calls,
        len(norms.norms),
    )


def test_unfused_and_no_clip_paths_read_the_same_pre_clip_gradients():
    jobs = [(_paths_worker, 2, (arm,)) for arm in ("fused", "unfused", "no-clip")]
    fused, unfused, no_clip = (
        run[0] for run in multiproc.run_jobs(jobs, preload=("megatron_patches",))
    )
    units = fused[4]
    for other in (unfused, no_clip):
        assert other[0] == pytest.approx(fused[0], rel=1e-6)  # the same per-unit norms
        assert other[1] == pytest.approx(fused[1], rel=1e-6)  # pre-clip global norm (> clip 1.0)
    assert fused[1] > 1.0 and unfused[2] == fused[2] == pytest.approx(fused[1], rel=1e-6)
    assert no_clip[2] == 0.0  # megatron computed no norm; GNMR read the same gradients itself
    grad_norm_reduces = lambda calls: [c for c in calls if c[0] == "all_reduce"]  # noqa: E731
    assert ("all_reduce", units + 3) in grad_norm_reduces(fused[3])
    assert ("all_reduce", 1) not in grad_norm_reduces(fused[3])  # megatron's rides along
    assert {("all_reduce", units + 2), ("all_reduce", 1)} <= set(grad_norm_reduces(unfused[3]))
    assert grad_norm_reduces(no_clip[3]) == [("all_reduce", units + 3)]  # GNMR's own, one


def test_error_term_without_a_reporting_backend_is_refused_before_patching():
    import megatron_patches

    with pytest.raises(ValueError, match=r"gnmr\.gamma .* gnmr\.backend=null \(observe only\)"):
        megatron_patches.enable(torch.nn.Linear(2, 2), {"gamma": 0.5})  # (te_fp8 needs CUDA)
    assert megatron_patches.current() is None
