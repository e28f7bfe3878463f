"""megatron_patches.enable at the settings Megatron users run, on every supported release.

For each setting of ``tests/integrations/megatron/settings.py`` (fp32 DP2; bf16 with bf16 and with
fp32 grad buffers; the distributed optimizer in fp32 and bf16; TP2 + sequence parallel; PP2 with two
virtual stages; TP2 x DP2 distributed optimizer bf16) and each release in ``MEGATRON_VERSIONS``,
the same training runs twice from the same weights and batches, GNMR off and GNMR on (observe
only, so both runs must be the same trajectory), with a x100 gradient spike injected into one
unit at step ``SPIKE + 1``. Checked:

* the per-unit norms of step 1 equal the float64 full model's (TP1, fp32, same weights and
  batch) within 1e-5 relative in fp32; bf16 within what its 8-bit mantissa allows (u = 2^-8
  relative plus 1e-3 of the global norm, the tolerance ``test_cpu_compat`` measured for single
  parameters; a unit sums several);
* the spiked unit is selected at the spike's decision, on every rank, and every rank takes the
  same decisions;
* the collectives of every step are the same with GNMR on and off, except that megatron's one
  clip-norm all-reduce carries U + 3 numbers instead of 1;
* megatron's reported grad norm and the losses are bitwise the same with GNMR on and off, on 2
  ranks and on 4, fp32 and bf16: megatron's total leads the fused vector, and gloo sums element
  0 of any vector in the order it sums megatron's own one-element vector
  (``test_gloo_order.py`` checks that property of gloo itself).

Plus: sequence parallel and virtual pipeline with an emulated backend train, and a
distributed-optimizer checkpoint taken at DP2 resumes at DP1 with the uninterrupted decisions.
"""

from __future__ import annotations

import math
import time
import traceback

import pytest
import torch

from tests.requires import require

require("megatron.core")

from tests import multiproc
from tests.integrations.megatron.settings import PRELOAD

STEPS, SPIKE, FACTOR = 5, 3, 100.0
SPIKE_UNIT = "decoder.layers.1.mlp.linear_fc1"
BLOCK = {"max_active": 2, "warmup_steps": 2, "lock_steps": 2}
BF16_U = 2.0**-8


def _spike(chunks, unit: str) -> None:
    """Multiply the reduced gradient of ``unit`` (its parameters' ``main_grad``) by FACTOR."""
    from gnmr_dist.distributed.units import global_param_names
    from gnmr_dist.integrations.megatron.operators import MEGATRON_MARKS

    for chunk in chunks:
        names = global_param_names(chunk, marks=MEGATRON_MARKS)
        for local, param in chunk.named_parameters():
            if names[local].startswith(unit + "."):
                param.main_grad.mul_(FACTOR)


def _arm(setting, full, block) -> dict:
    """Train ``STEPS`` steps; with ``block``, GNMR applied (what it saw and decided)."""
    from megatron.core import parallel_state as ps

    import megatron_patches
    from tests.integrations.megatron import settings

    chunks, opt = settings.build(setting, full)
    handle = megatron_patches.enable(chunks, block, optimizer=opt) if block is not None else None
    out: dict = {"calls": [], "norms": [], "losses": [], "decisions": [], "unit_norms": []}
    for step in range(STEPS):
        with multiproc.CollectiveSpy() as spy:
            out["losses"].append(settings.train_step(chunks, step))
            if step == SPIKE:
                _spike(chunks, SPIKE_UNIT)
            if handle is not None and handle.backend is not None and step == STEPS - 1:
                report = handle.backend.report()  # what the last step's forwards ran
                out["report"] = {
                    "planned": set(report.planned),
                    "ran": set(report.ran),
                    "recovered": set(report.recovered),
                    "low_cost": set(report.low_cost),
                }
            ok, norm, _ = opt.step()
        assert ok
        out["calls"].append(spy.calls)
        out["norms"].append(norm if isinstance(norm, float) else float(norm))
        if handle is not None:
            decision = handle.last_decision
            out["decisions"].append((decision.step, decision.active, decision.risk.tolist()))
            out["unit_norms"].append(handle.runtime.last_norms.norms.tolist())
    if handle is not None:
        out["units"] = handle.registry.names
        megatron_patches.disable()
    ps.destroy_model_parallel()
    return out


def _gnmr_worker(rank, world, names, backend_names):
    """GNMR off and on for every setting in ``names``; a setting's failure is its result."""
    import warnings

    from megatron.core import parallel_state as ps

    from gnmr_dist.integrations.megatron.versions import series_info
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import settings

    warnings.filterwarnings("ignore")
    enable_cpu_compat()
    results: dict = {"version": settings.megatron_version(), "series": series_info().checked}
    chosen = [settings.SETTINGS_BY_NAME[n] for n in names]
    with settings.full_layout():
        full = settings.full_model()
        refs = {dp: settings.reference_grads(full, dp, 0)[1] for dp in {s.dp for s in chosen}}
    # plain Python only: another release's megatron registers pickling hooks for tensors
    squares = {dp: {n: float(g.square().sum()) for n, g in ref.items()} for dp, ref in refs.items()}
    for setting in chosen:
        start = time.perf_counter()
        try:
            off, on = _arm(setting, full, None), _arm(setting, full, BLOCK)
            result = {"off": off, "on": on, "ref": squares[setting.dp]}
            if setting.name in backend_names:
                result["backend"] = _arm(setting, full, {**BLOCK, "backend": "fp8_emulated"})
            result["seconds"] = time.perf_counter() - start
            results[setting.name] = result
        except Exception:
            results[setting.name] = traceback.format_exc()
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    return results


BACKEND_SETTINGS = ("tp2-sp", "pp2-vpp2")
_RUNS = None


def _ranks(version: str, name: str) -> list[dict]:
    global _RUNS
    if _RUNS is None:
        from tests.integrations.megatron.settings import ReleaseRuns

        _RUNS = ReleaseRuns(_gnmr_worker, BACKEND_SETTINGS, preload=PRELOAD)
    ranks = _RUNS.ranks(version, name)
    assert _RUNS.release(version)["meta"]["series"] == [version]  # the table row's release
    return ranks


def _params():
    from tests.integrations.megatron.settings import matrix_params

    return matrix_params()


def reference_unit_norms(squares: dict[str, float], units: tuple[str, ...]) -> torch.Tensor:
    """float64 [U]: each unit's norm from the full model's per-parameter squared gradients."""
    sums = torch.zeros(len(units), dtype=torch.float64)
    for name, square in squares.items():
        owner = [i for i, u in enumerate(units) if name.startswith(u + ".")]
        if owner:
            sums[owner[0]] += square
    return sums.sqrt()


@pytest.mark.parametrize("name, version", _params())
def test_unit_norms_equal_the_full_model(name, version):
    from tests.integrations.megatron.settings import SETTINGS_BY_NAME

    setting = SETTINGS_BY_NAME[name]
    for r in _ranks(version, name):
        expected = reference_unit_norms(r["ref"], r["on"]["units"])
        got = torch.tensor(r["on"]["unit_norms"][0], dtype=torch.float64)
        assert bool((expected > 0).all())
        if setting.bf16:  # 8-bit mantissas: relative u, plus 1e-3 of the global norm
            scale = math.sqrt(sum(r["ref"].values()))
            assert torch.allclose(got, expected, rtol=BF16_U, atol=1e-3 * scale), (got, expected)
        else:
            assert torch.allclose(got, expected, rtol=1e-5, atol=0), (got - expected) / expected


@pytest.mark.parametrize("name, version", _params())
def test_spike_is_selected_on_every_rank(name, version):
    ranks = _ranks(version, name)
    units = ranks[0]["on"]["units"]
    spiked = units.index(SPIKE_UNIT)
    for r in ranks:
        step, active, risk = r["on"]["decisions"][SPIKE]
        assert step == SPIKE + 1 and spiked in active
        assert max(range(len(risk)), key=risk.__getitem__) == spiked
        for mine, first in zip(r["on"]["decisions"], ranks[0]["on"]["decisions"], strict=True):
            assert mine[1] == first[1] and mine[2] == first[2]  # bit-identical on every rank


@pytest.mark.parametrize("name, version", _params())
def test_same_collectives_and_same_megatron_norm(name, version):
    for r in _ranks(version, name):
        off, on = r["off"], r["on"]
        u = len(on["units"])
        for off_calls, on_calls in zip(off["calls"], on["calls"], strict=True):
            assert [c[0] for c in on_calls] == [c[0] for c in off_calls]
            changed = [(a, b) for a, b in zip(off_calls, on_calls, strict=True) if a != b]
            assert changed == [(("all_reduce", 1), ("all_reduce", u + 3))]
        # megatron's entry leads the fused vector, where gloo sums it in its own order
        assert on["norms"] == off["norms"]  # bitwise, on 2 ranks and on 4
        assert on["losses"] == off["losses"]  # observe mode: the same trajectory


@pytest.mark.parametrize(
    "name, version",
    [
        pytest.param(n, v, id=f"{n}-mcore{v}", marks=pytest.mark.slow)
        for v in ("0.16.1", "0.17.1", "0.19.2")
        for n in BACKEND_SETTINGS
    ],
)
def test_emulated_backend_runs_sequence_parallel_and_virtual_pipeline(name, version):
    ranks = _ranks(version, name)
    recovered: set[int] = set()
    for r in ranks:
        run, off = r["backend"], r["off"]
        assert all(math.isfinite(x) for x in run["losses"])
        # FP8 emulation perturbs the loss a little, never beyond a few percent at this scale
        assert run["losses"][0] == pytest.approx(off["losses"][0], rel=0.05)
        report = run["report"]
        assert report["planned"] & report["ran"] <= report["recovered"]  # this rank ran the plan
        assert report["low_cost"] - report["planned"]  # the rest stayed on the low-cost path
        recovered |= report["recovered"]
    planned = ranks[0]["backend"]["report"]["planned"]
    assert planned and recovered == planned  # the ranks holding a planned unit ran it, no other


# ---------------------------------------------------------------------- resume at another DP size

RESUME_STEPS, RESUME_AT, RESUME_SPIKE = 6, 3, 4


def _dp_train_step(chunks, step: int, as_dp: int) -> None:
    """One step on DP1 that feeds every micro-batch ``as_dp`` DP ranks would have fed."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.integrations.megatron import gpt

    for chunk in chunks:
        chunk.zero_grad_buffer()
        for param in chunk.parameters():
            param.grad = None
    batches = [gpt.micro_batch(d, m, step) for d in range(as_dp) for m in range(gpt.NUM_MICRO)]
    get_forward_backward_func()(
        forward_step_func=gpt.forward_step,
        data_iterator=iter(batches),
        model=chunks,
        num_microbatches=len(batches),
        seq_length=gpt.SEQ,
        micro_batch_size=gpt.MICRO_BATCH,
        forward_only=False,
    )


def _sharded(chunks, opt, is_loading: bool) -> dict:
    """Megatron-LM's checkpoint layout; the optimizer in its DP-reshardable canonical form."""
    state = {"model": chunks[0].module.sharded_state_dict()}
    state["optimizer"] = opt.sharded_state_dict(
        state["model"],
        is_loading=is_loading,
        metadata={"distrib_optim_sharding_type": "fully_reshardable"},
    )
    return state


def _resume_worker(rank, world, ckpt: str, resume: bool):
    """DP2 uninterrupted (saving at RESUME_AT), or DP1 resumed from that checkpoint."""
    import warnings

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import megatron_patches
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat
    from tests.integrations.megatron import settings

    warnings.filterwarnings("ignore")
    enable_cpu_compat()
    with settings.full_layout():
        full = settings.full_model()
    setting = settings.Setting(f"distopt-dp{world}", dp=world, distributed_optimizer=True)
    chunks, opt = settings.build(setting, full)
    handle = megatron_patches.enable(chunks, BLOCK, optimizer=opt)
    start = 0
    if resume:
        state = dist_checkpointing.load(_sharded(chunks, opt, is_loading=True), ckpt)
        chunks[0].module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        handle.load_state_dict(state["gnmr"])
        start = RESUME_AT
    decisions = []
    for step in range(start, RESUME_STEPS):
        if resume and world == 1:
            _dp_train_step(chunks, step, as_dp=2)
        else:
            settings.train_step(chunks, step)
        if step == RESUME_SPIKE:
            _spike(chunks, SPIKE_UNIT)
        opt.step()
        decision = handle.last_decision
        decisions.append((decision.step, decision.active, decision.risk.tolist()))
        if not resume and step + 1 == RESUME_AT:
            state = _sharded(chunks, opt, is_loading=False)
            state["gnmr"] = handle.state_dict()
            dist_checkpointing.save(state, ckpt)
    megatron_patches.disable()
    ps.destroy_model_parallel()
    return decisions


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.16.1", "0.17.1", "0.19.2"])
def test_distributed_optimizer_checkpoint_resumes_at_another_dp_size(tmp_path, version):
    """DP2 saves at step 3; DP1 and DP2 resume from that checkpoint and decide as DP2 did."""
    from tests.integrations.megatron import settings

    sys_path = settings.version_sys_path(version)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    jobs = [(_resume_worker, 2, (str(ckpt), False))]
    jobs += [(_resume_worker, world, (str(ckpt), True)) for world in (1, 2)]
    uninterrupted, dp1, dp2 = multiproc.run_jobs(jobs, sys_path_prepend=sys_path, preload=PRELOAD)
    expected = uninterrupted[0][RESUME_AT:]
    assert dp2[0] == expected and dp2[1] == uninterrupted[1][RESUME_AT:]  # same layout: bitwise
    got = dp1[0]
    assert [d[0] for d in got] == list(range(RESUME_AT + 1, RESUME_STEPS + 1))
    assert [d[1] for d in got] == [d[1] for d in expected]  # the same active sets
    spiked = expected[RESUME_SPIKE - RESUME_AT][1]
    assert spiked and got[RESUME_SPIKE - RESUME_AT][1] == spiked  # the spike, after the resume
    for (_, _, risk), (_, _, want) in zip(got, expected, strict=True):
        # DP1 sums the same micro-batches in another order than DP2's reduce-scatter
        assert risk == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------- no host sync (0.17+)


def _tensor_norm_worker(rank, world):
    """megatron 0.17+ returns the norm as a tensor when TE's tensor-scale kernel exists."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import clip_grads

    import megatron_patches
    from gnmr_dist.integrations.megatron.versions import series_info
    from tests.integrations.megatron import settings

    chunks, opt, handle = settings.patched(settings.SETTINGS_BY_NAME["fp32-dp2"], BLOCK)
    settings.train_step(chunks, 0)
    opt.prepare_grads()
    leaf = opt.chained_optimizers[0]
    grads = list(getattr(leaf, handle.info.grads_for_norm)())
    group = leaf.get_grad_stats_parallel_group()
    clip_grads.multi_tensor_scale_tensor_impl = object()  # TE's kernel "exists": tensor return
    original = clip_grads.get_grad_norm_fp32
    expected = original(grads, 2.0, group)
    handle.begin_step()
    item = torch.Tensor.item
    if series_info().norm_may_be_tensor:  # 0.16 itself calls .item(); 0.17+ must not
        torch.Tensor.item = None  # any host sync in the call would raise
    try:
        got = handle.norm_with_units(grads, group, original)
    finally:
        torch.Tensor.item = item
    handle.collecting = False
    megatron_patches.disable()
    ps.destroy_model_parallel()
    return (
        series_info().norm_may_be_tensor,
        type(expected).__name__,
        type(got).__name__,
        (float(got) == float(expected)),
    )


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.16.1", "0.17.1", "0.19.2"])
def test_fused_norm_returns_what_megatron_returns_without_a_host_sync(version):
    from tests.integrations.megatron import settings

    sys_path = settings.version_sys_path(version)
    runs = multiproc.run_jobs([(_tensor_norm_worker, 2, ())], sys_path_prepend=sys_path)
    for tensor_series, expected, got, same in runs[0]:
        want = "Tensor" if tensor_series else "float"
        assert (expected, got, same) == (want, want, True)


# ---------------------------------------------------------------------- the error term (2.1)

ERROR_BLOCK = {**BLOCK, "backend": "act_quant", "gamma": 0.5, "low_cost": {"bits": 2}}


def _error_worker(rank, world, name):
    """One step with gnmr.gamma: the reduced error sums, errors, decisions and collectives."""
    from megatron.core import parallel_state as ps

    import megatron_patches
    from tests.integrations.megatron import settings

    setting = settings.SETTINGS_BY_NAME[name] if world > 1 else settings.Setting("dp1", dp=1)
    chunks, opt, handle = settings.patched(setting, ERROR_BLOCK)
    if world == 1:
        _dp_train_step(chunks, 0, as_dp=2)
    else:
        settings.train_step(chunks, 0)
    with multiproc.CollectiveSpy() as spy:
        opt.step()
    decision = handle.last_decision
    norms = handle.runtime.last_norms
    out = {
        "sums": norms.error_sums.tolist(),
        "norms": norms.norms.tolist(),
        "global": norms.global_norm,
        "error": decision.error.tolist(),
        "calls": spy.calls,
        "units": handle.registry.names,
    }
    megatron_patches.disable()
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def error_runs():
    """DP1, DP2 plain and DP2 distributed-optimizer error sums, and the error_every run: one
    ``run_jobs`` call (one worker pool) for both error-term tests."""
    names = ("fp32-dp2", "distopt-fp32-dp2")
    jobs = [(_error_worker, 1, ("dp1",))] + [(_error_worker, 2, (n,)) for n in names]
    return multiproc.run_jobs([*jobs, (_error_every_worker, 2, ())], preload=PRELOAD)


@pytest.mark.slow
def test_error_sums_are_summed_over_dp_and_scaled_like_the_gradient(error_runs):
    single, plain, distopt, _ = error_runs
    ref = single[0]
    u = len(ref["units"])
    assert max(ref["sums"]) > 0
    for run in (plain, distopt):
        for r in run:  # every rank holds the same reduced vector
            assert r["sums"] == run[0]["sums"] and r["error"] == run[0]["error"]
            assert r["sums"] == pytest.approx(ref["sums"], rel=1e-5)  # DP2 = DP1 on all batches
            assert r["error"] == pytest.approx([b / r["global"] for b in r["sums"]], rel=1e-12)
    reduces = lambda r: [c for c in r["calls"] if c[0] == "all_reduce"]  # noqa: E731
    # plain optimizer: the clip norm's group is model-parallel, the DP partials take one more
    assert reduces(plain[0]) == [("all_reduce", u), ("all_reduce", 2 * u + 3)]
    # distributed optimizer: everything rides megatron's one clip-norm all-reduce
    assert ("all_reduce", 2 * u + 3) in reduces(distopt[0])
    assert ("all_reduce", u) not in reduces(distopt[0]) and ("all_reduce", 1) not in reduces(
        distopt[0]
    )


def _error_every_worker(rank, world):
    """Three steps with gnmr.error_every = 2 under the distributed optimizer."""
    from megatron.core import parallel_state as ps

    import megatron_patches
    from tests.integrations.megatron import settings

    setting = settings.SETTINGS_BY_NAME["distopt-fp32-dp2"]
    chunks, opt, handle = settings.patched(setting, {**ERROR_BLOCK, "error_every": 2})
    out = []
    for step in range(3):
        settings.train_step(chunks, step)
        with multiproc.CollectiveSpy() as spy:
            opt.step()
        decision, norms = handle.last_decision, handle.runtime.last_norms
        sums = None if norms.error_sums is None else norms.error_sums.tolist()
        out.append(
            {
                "sums": sums,
                "global": norms.global_norm,
                "error": decision.error.tolist(),
                "calls": [c for c in spy.calls if c[0] == "all_reduce"],
            }
        )
    units = handle.registry.num_units
    megatron_patches.disable()
    ps.destroy_model_parallel()
    return units, out


@pytest.mark.slow
def test_error_every_rides_the_clip_norm_only_on_its_steps_and_carries_e_between(error_runs):
    ((u, out), _) = error_runs[3]
    one, two, three = out
    assert one["sums"] is None and two["sums"] is not None and three["sums"] is None
    assert one["error"] == [0.0] * u  # nothing measured yet: the term is silent
    assert two["error"] == pytest.approx([b / two["global"] for b in two["sums"]], rel=1e-12)
    assert three["error"] == two["error"]  # carried forward
    assert ("all_reduce", 2 * u + 3) in two["calls"]
    assert ("all_reduce", 2 * u + 3) not in one["calls"] + three["calls"]
    assert ("all_reduce", u + 3) in one["calls"] and ("all_reduce", u + 3) in three["calls"]
