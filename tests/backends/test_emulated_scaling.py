"""Delayed scaling (Transformer Engine's recipe) in the ``fp8_emulated`` backend.

The references are written out here: a list of past amaxes per GEMM input, the scale of step t
from the entries of steps t-H..t-1 (``max`` or the most recent, times ``2^margin``), and the
quantization ``round(x / s) * s`` with saturation, from :func:`round_to_format` alone. A linear
whose weight is the identity exposes the quantized input: ``y = Q(x)`` and ``dx = Q(dy)``
(``Q(I) = I`` exactly in every format: 1 is representable).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gnmr_dist.backends import get_backend
from gnmr_dist.backends.emulated import EmulatedBackend
from gnmr_dist.backends.emulated_options import DelayedRecipe, EmulatedOptions
from gnmr_dist.backends.numerics.formats import FORMATS
from gnmr_dist.backends.numerics.rounding import round_to_format
from gnmr_dist.backends.numerics.scaled import quantize_dequantize, sqnr_db
from gnmr_dist.distributed import UnitRegistry
from gnmr_dist.distributed.probe import RecoveryProbe
from tests.distributed.test_probe import loss_of, make_net, tokens

CPU = torch.device("cpu")


def delayed(fmt="e4m3", **kw):
    return {"format": fmt, "granularity": "tensor", "scaling": "delayed", **kw}


def randn(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def identity_unit(low_cost, width=64, **kw):
    """(backend, linear with W = I, no bias) wrapped as unit 0."""
    lin = nn.Linear(width, width, bias=False)
    lin.weight.data = torch.eye(width)
    backend = EmulatedBackend(low_cost=low_cost, **kw)
    backend.wrap({0: lin})
    return backend, lin


def quantized_input(lin, x, dy=None):
    """``(Q(x), Q(dy))`` through the identity linear (one forward and backward)."""
    x = x.detach().clone().requires_grad_()
    y = lin(x)
    y.backward(torch.zeros_like(y) if dy is None else dy)
    return y.detach(), x.grad


# --------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "low_cost, message",
    [
        ({"scaling": "late"}, r"gnmr\.low_cost\.scaling must be one of \['current', 'delayed'\]"),
        (
            {"scaling": "delayed"},
            r"gnmr\.low_cost\.scaling 'delayed' keeps one amax history per tensor .* got "
            r"granularity None \(= 'block'\); set \"granularity\": \"tensor\"",
        ),
        (
            {"scaling": "delayed", "granularity": "row"},
            r"gnmr\.low_cost\.scaling 'delayed' .* got granularity 'row'; set \"granularity\"",
        ),
        (
            {"amax_history_len": 8},
            r"gnmr\.low_cost\.amax_history_len applies only to delayed scaling \(scaling is "
            r"'current'\); add \"scaling\": \"delayed\"",
        ),
        ({"granularity": "tensor", "margin": 1}, r"gnmr\.low_cost\.margin applies only to"),
        (delayed(amax_history_len=0), r"gnmr\.low_cost\.amax_history_len must be an integer >= 1"),
        (delayed(amax_history_len=True), r"gnmr\.low_cost\.amax_history_len must be an integer"),
        (delayed(amax_history_len=2.0), r"gnmr\.low_cost\.amax_history_len must be an integer"),
        (
            delayed(amax_compute_algo="mean"),
            r"gnmr\.low_cost\.amax_compute_algo must be one of \['max', 'most_recent'\], got "
            r"'mean'",
        ),
        (delayed(margin=-1), r"gnmr\.low_cost\.margin must be an integer >= 0, got -1"),
        (delayed(amax_history=4), r"gnmr\.low_cost\.amax_history; did you mean 'amax_history_len'"),
    ],
)
def test_option_errors_name_the_key_the_value_and_the_fix(low_cost, message):
    with pytest.raises(ValueError, match=message):
        get_backend("fp8_emulated", low_cost=low_cost)


def test_recovery_block_is_parsed_with_its_own_path():
    with pytest.raises(ValueError, match=r"gnmr\.recovery\.scaling 'delayed' .* granularity"):
        EmulatedBackend(recovery={"scaling": "delayed"})


def test_option_defaults():
    assert EmulatedOptions().scaling == "current" and EmulatedOptions().delayed is None
    assert EmulatedOptions(**delayed()).delayed == DelayedRecipe(16, "max", 0)
    got = EmulatedOptions(
        **delayed(amax_history_len=1024, amax_compute_algo="most_recent", margin=0)
    )
    assert got.delayed == DelayedRecipe(1024, "most_recent", 0)
    assert EmulatedBackend(low_cost=delayed()).specs["low_cost"].delayed == DelayedRecipe()
    assert EmulatedBackend().specs["low_cost"].delayed is None


# ------------------------------------------------------------------- current is unchanged


def _run(backend_kwargs, steps=3, plan=()):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 96), nn.ReLU(), nn.Linear(96, 48))
    backend = EmulatedBackend(**backend_kwargs)
    backend.wrap({0: model[0], 1: model[2]})
    backend.track_errors(2)
    out = []
    for step in range(1, steps + 1):
        backend.apply(plan, step)
        x = randn(5, 7, 200, seed=step, scale=float(step))
        y = model(x)
        y.square().sum().backward()
        out += [y.detach(), *(p.grad.clone() for p in model.parameters())]
        out.append(backend.error_sums(CPU))
        model.zero_grad()
    return model, out


@pytest.mark.parametrize("granularity", [None, "tensor", "row", "block"])
@pytest.mark.parametrize("plan", [(), (1,)])
def test_current_scaling_is_the_default_and_its_numbers_do_not_move(granularity, plan):
    """``"scaling": "current"`` equals the option left out, and the per-call tensor scales of
    current scaling, bit for bit (outputs, gradients, error sums over three steps)."""
    low = {"granularity": granularity}
    _, want = _run({"low_cost": low}, plan=plan)
    _, got = _run({"low_cost": {**low, "scaling": "current"}}, plan=plan)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_current_tensor_scaling_equals_explicit_dequantized_gemm():
    backend, lin = identity_unit({"granularity": "tensor"})
    backend.apply((), 1)
    for seed in range(3):
        x, dy = randn(16, 64, seed=seed, scale=10.0**seed), randn(16, 64, seed=9 + seed)
        qx, qdy = quantized_input(lin, x, dy)
        assert torch.equal(qx, quantize_dequantize(x, "e4m3", "tensor"))
        assert torch.equal(qdy, quantize_dequantize(dy, "e4m3", "tensor"))


def test_first_delayed_step_is_current_tensor_scaling_bit_for_bit():
    """An empty history scales each call by its own amax (module docstring)."""
    _, want = _run({"low_cost": {"granularity": "tensor"}}, steps=1)
    _, got = _run({"low_cost": delayed()}, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# ------------------------------------------------------------------ history semantics


class Reference:
    """Delayed scaling of one tensor, written out: a list of past step amaxes."""

    def __init__(self, fmt, length, algo, margin):
        self.fmt, self.length, self.algo, self.margin = FORMATS[fmt], length, algo, margin
        self.amaxes: list[float] = []

    def quantize(self, t):
        """``Q(t)`` at this step's scale; then ``amax(t)`` is this step's entry."""
        past = self.amaxes[-self.length :]
        a = float(t.abs().max()) if not past else (max(past) if self.algo == "max" else past[-1])
        s = torch.tensor(a, dtype=torch.float32) / self.fmt.max_value * 2.0**self.margin
        self.amaxes.append(float(t.abs().max()))
        return round_to_format(t / s, self.fmt) * s


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_scale_of_step_t_comes_from_the_amaxes_of_steps_t_minus_h_to_t_minus_1(algo, margin):
    """y, dx and dW of a real linear (its weight changing every step) over 9 steps with
    magnitudes that rise and fall, against the reference's quantized x, W and dy."""
    h, fmt = 3, "e4m3"
    torch.manual_seed(0)
    lin = nn.Linear(48, 40)
    backend = EmulatedBackend(
        low_cost=delayed(fmt, amax_history_len=h, amax_compute_algo=algo, margin=margin)
    )
    backend.wrap({0: lin})
    ref_x, ref_w, ref_dy = (Reference(fmt, h, algo, margin) for _ in range(3))
    mags = [1.0, 3.0, 0.5, 2.0, 0.1, 0.1, 5.0, 1.0, 0.3]
    for step, mag in enumerate(mags, start=1):
        backend.apply((), step)
        lin.weight.data.mul_(1.0 + 0.3 * (-1) ** step)
        x = randn(6, 48, seed=step, scale=mag).requires_grad_()
        dy = randn(6, 40, seed=100 + step, scale=1.0 / mag)
        y = lin(x)
        y.backward(dy)
        qx, qw, qdy = ref_x.quantize(x.detach()), ref_w.quantize(lin.weight.detach()), None
        qdy = ref_dy.quantize(dy)
        assert torch.equal(y.detach(), qx @ qw.t() + lin.bias.detach()), step
        assert torch.equal(x.grad, qdy @ qw), step
        assert torch.equal(lin.weight.grad, qdy.t() @ qx), step
        lin.zero_grad()


def test_a_spike_saturates_under_delayed_scaling_only():
    """Step 4's input x100: its scale still comes from steps 1-3, so everything beyond
    ``448 * s`` clamps there; current scaling fits the spike and keeps ~31 dB."""
    backend, lin = identity_unit(delayed(amax_history_len=4))
    current, lin_c = identity_unit({"granularity": "tensor"})
    past = []
    for step in range(1, 5):
        backend.apply((), step)
        current.apply((), step)
        x = randn(32, 64, seed=step, scale=100.0 if step == 4 else 1.0)
        qx, _ = quantized_input(lin, x)
        qc, _ = quantized_input(lin_c, x)
        if step < 4:
            past.append(float(x.abs().max()))
            assert sqnr_db(x, qx) > 28.0
    edge = 448.0 * (torch.tensor(max(past)) / 448.0)  # the largest value step 4 represents
    clamped = x.abs() > float(edge)
    assert float(qx.abs().max()) == pytest.approx(float(edge), rel=1e-6)
    assert int(clamped.sum()) > 0.9 * x.numel()
    assert torch.equal(qx[clamped].abs(), torch.full_like(qx[clamped], float(qx.abs().max())))
    assert sqnr_db(x, qx) < 1.0 and sqnr_db(x, qc) > 28.0


@pytest.mark.parametrize("algo, hurt", [("max", [5, 6, 7]), ("most_recent", [5])])
def test_after_a_spike_the_scale_stays_too_large_for_up_to_h_steps(algo, hurt):
    """FP6 e3m2 (0.0625 .. 28), H = 3, step 4 x100. The spike's amax makes the next steps' scale
    100x too large: values fall into the subnormals and to zero, ~13 dB lost, for the 3 steps it
    stays in the window ("max") or the one step it is the most recent; then it is as before."""
    backend, lin = identity_unit(delayed("e3m2", amax_history_len=3, amax_compute_algo=algo))
    sqnr, zeros = {}, {}
    for step in range(1, 10):
        backend.apply((), step)
        x = randn(32, 64, seed=step, scale=100.0 if step == 4 else 1.0)
        qx, _ = quantized_input(lin, x)
        sqnr[step], zeros[step] = sqnr_db(x, qx), float((qx == 0).float().mean())
    for step in (2, 3, *(s for s in range(5, 10) if s not in hurt)):
        assert 24.0 < sqnr[step] < 27.0 and zeros[step] < 0.01, step
    for step in hurt:
        assert sqnr[step] < 14.0 and zeros[step] > 0.05, step


def test_recomputation_reproduces_the_forward_and_adds_one_entry():
    """Every forward of a step reads one scale: checkpointed and plain gradients agree bit for
    bit, and the step still adds one history entry (the max over its calls)."""
    grads = {}
    for mode in ("plain", "reentrant", "non-reentrant"):
        torch.manual_seed(0)
        lin = nn.Linear(48, 40)
        backend = EmulatedBackend(low_cost=delayed(amax_history_len=4))
        backend.wrap({0: lin})
        for step in range(1, 4):
            backend.apply((), step)
            x = randn(6, 48, seed=step, scale=float(step)).requires_grad_()
            y = lin(x) if mode == "plain" else checkpoint(lin, x, use_reentrant=mode == "reentrant")
            y.backward(randn(6, 40, seed=50 + step))
        grads[mode] = (x.grad, lin.weight.grad)
        assert backend.delayed_scales(lin).x.filled == 2  # steps 1, 2 committed
    for mode in ("reentrant", "non-reentrant"):
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["plain"], strict=True))


# -------------------------------------------------------------- recovery and the probe


def test_return_from_recovery_resets_the_histories():
    """Steps 1-2 at x100 fill the history; steps 3-4 on recovery; at step 5 the unit is back
    and scales by its own amax (current scaling, bit for bit), where a unit that stayed on the
    low-cost path still uses the stale amax and loses its small values."""
    back, lin = identity_unit(delayed("e3m2", amax_history_len=8))
    stayed, lin_s = identity_unit(delayed("e3m2", amax_history_len=8))
    plans = {1: (), 2: (), 3: (0,), 4: (0,), 5: ()}
    for step, plan in plans.items():
        back.apply(plan, step)
        stayed.apply((), step)
        x = randn(32, 64, seed=step, scale=100.0 if step <= 2 else 1.0)
        dy = randn(32, 64, seed=20 + step)
        qx, qdy = quantized_input(lin, x, dy)
        if step <= 2:
            quantized_input(lin_s, x, dy)
    assert back.report().low_cost == {0}
    assert torch.equal(qx, quantize_dequantize(x, "e3m2", "tensor"))
    assert torch.equal(qdy, quantize_dequantize(dy, "e3m2", "tensor"))
    qs, _ = quantized_input(lin_s, x, dy)
    assert sqnr_db(x, qs) < sqnr_db(x, qx) - 10.0


def _bound(x, dy, s_x, s_dy, fmt="e4m3"):
    """``||dy|| ||x - Q(x)|| + ||Q(dy) - dy|| ||x||`` in float64 at the given scales."""

    def q(t, s):
        return round_to_format(t / s, fmt) * s

    n = torch.linalg.vector_norm
    x, dy = x.double(), dy.double()
    return float(n(dy) * n(x - q(x.float(), s_x)) + n(q(dy.float(), s_dy) - dy) * n(x))


def test_a_recovered_units_shadow_scores_a_return_and_records_nothing():
    """Steps 1-2 low-cost; steps 3-4 recovered with x and dy x1e4. A return would reset the
    history, so the shadow scales each call by its own amax (what the first step back does),
    not by the frozen scale of steps 1-2 (which would saturate and score a path that never
    runs again); the low-cost histories record nothing meanwhile."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    backend = EmulatedBackend(low_cost=delayed(amax_history_len=4))
    backend.wrap({0: lin})
    backend.track_errors(1)
    amax_x, amax_dy = [], []
    for step, plan in {1: (), 2: (), 3: (0,), 4: (0,)}.items():
        backend.apply(plan, step)
        scale = 1e4 if step > 2 else 1.0
        x = randn(16, 64, seed=step, scale=scale).requires_grad_()
        dy = randn(16, 32, seed=30 + step, scale=scale)
        lin(x).backward(dy)
        if step <= 2:
            amax_x.append(float(x.detach().abs().max()))
            amax_dy.append(float(dy.abs().max()))
        else:
            s_x = x.detach().abs().max() / 448.0
            s_dy = dy.abs().max() / 448.0
            want = _bound(x.detach(), dy, s_x, s_dy)
            frozen = _bound(x.detach(), dy, max(amax_x) / 448.0, max(amax_dy) / 448.0)
            assert frozen > 10 * want  # the frozen scale would have saturated
            assert float(backend.error_sums(CPU)[0]) == pytest.approx(want, rel=1e-5), step
            assert backend.delayed_scales(lin).x.filled == 2
    assert backend.delayed_scales(lin).dy.step_amax is None


def test_a_spike_raises_the_error_sum_more_under_delayed_scaling():
    """Step 4's input x100. Current scaling keeps the relative error: ``B`` grows ~100x with
    ``||x||``. Delayed scaling saturates: ``||x - Q(x)||`` is most of ``||x||``, ``B`` grows
    by more than 1000x."""
    ratios = {}
    for mode in ("delayed", "current"):
        torch.manual_seed(0)
        lin = nn.Linear(64, 32)
        low = delayed(amax_history_len=4) if mode == "delayed" else {"granularity": "tensor"}
        backend = EmulatedBackend(low_cost=low)
        backend.wrap({0: lin})
        backend.track_errors(1)
        b = []
        for step in range(1, 5):
            backend.apply((), step)
            x = randn(16, 64, seed=step, scale=100.0 if step == 4 else 1.0).requires_grad_()
            lin(x).backward(randn(16, 32, seed=40 + step))
            b.append(float(backend.error_sums(CPU)[0]))
        ratios[mode] = b[3] / b[2]
    assert 50.0 < ratios["current"] < 200.0
    assert ratios["delayed"] > 10 * ratios["current"]


def test_measuring_reads_the_histories_and_changes_nothing():
    backend, lin = identity_unit(delayed(amax_history_len=4))
    for step in (1, 2):
        backend.apply((), step)
        quantized_input(lin, randn(8, 64, seed=step))
    backend.apply((), 3)
    state = backend.delayed_scales(lin)
    before = (state.x.filled, state.x.history.clone(), state.x.scale())
    with backend.measuring():
        quantized_input(lin, randn(8, 64, seed=9, scale=1e3), randn(8, 64, seed=10))
        backend.apply((0,), 3)
        backend.apply((), 3)  # back from recovery: no reset inside
        quantized_input(lin, randn(8, 64, seed=11))
    assert state.x.filled == before[0] and torch.equal(state.x.history, before[1])
    assert torch.equal(state.x.scale(), before[2])
    assert all(h.step_amax is None for h in state.histories)


def _train(probe_every_step, plans, measuring=True):
    """Losses and final parameters of six AdamW steps, delayed e4m3 on the low-cost path."""
    model = make_net()
    registry = UnitRegistry.from_model(model)
    backend = get_backend("fp8_emulated", low_cost=delayed(amax_history_len=3))
    backend.wrap(registry.local_modules)
    if not measuring:
        backend.measuring = contextlib.nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    probe = RecoveryProbe(registry, backend, opt)
    losses = []
    for step, plan in enumerate(plans, start=1):
        backend.apply(plan, step)
        batch = tokens(seed=step)
        if probe_every_step:
            probe.measure(lambda batch=batch: loss_of(model, batch))
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_probe_every_step_leaves_the_training_run_bit_for_bit_unchanged():
    """Plans move units on and off recovery (resets happen); the probe's two passes read the
    histories and record nothing. Without ``measuring`` the same probe changes the run."""
    plans = [(), (1,), (1, 4), (), (0, 2), ()]
    want_losses, want_params = _train(False, plans)
    got_losses, got_params = _train(True, plans)
    assert got_losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params, strict=True))
    bad_losses, _ = _train(True, plans, measuring=False)
    assert bad_losses != want_losses


def _spiked_run(unit_name, spike_at=3):
    """(model, registry, backend) after two low-cost steps; from step ``spike_at`` on, the
    input of ``unit_name`` is x1e3 (so its frozen history would saturate it)."""
    model = make_net()
    registry = UnitRegistry.from_model(model)
    backend = get_backend("fp8_emulated", low_cost=delayed(amax_history_len=4))
    backend.wrap(registry.local_modules)
    step = [0]

    def spike(_m, args):
        return (args[0] * 1e3,) if step[0] >= spike_at else None

    model.get_submodule(unit_name).register_forward_pre_hook(spike)
    for s in (1, 2):
        step[0] = s
        backend.apply((), s)
        loss_of(model, tokens(seed=s)).backward()
    step[0] = spike_at
    return model, registry, backend


def _unit_norms(registry, model, loss):
    grads = torch.autograd.grad(loss, list(model.parameters()))
    by_param = {id(p): g for p, g in zip(model.parameters(), grads, strict=True)}
    sums = torch.zeros(registry.num_units, dtype=torch.float64)
    for p, slot in zip(registry.params, registry.param_slots.tolist(), strict=True):
        if slot < registry.num_units:
            sums[slot] += float(by_param[id(p)].double().square().sum())
    return sums.sqrt()


def test_the_probe_scores_a_recovered_unit_by_its_return_not_its_frozen_history():
    """Step 3: ``layers.1.fc2`` recovered while its input spikes x1e3. The probe's low-cost pass
    equals, for every unit, an ordinary step 3 on which that unit really returns (its history
    reset, its own amax), within 1e-6; the frozen history would score a saturating path that
    never runs again (a far larger gradient error)."""
    name = "layers.1.fc2"
    model, registry, backend = _spiked_run(name)
    uid = registry.index[name]
    backend.apply((uid,), 3)
    probe = RecoveryProbe(registry, backend)
    batch = tokens(seed=3)
    got = probe.measure(lambda: loss_of(model, batch))

    ref_model, ref_reg, ref_backend = _spiked_run(name)
    ref_backend.apply((uid,), 3)
    ref_backend.apply((), 3)  # the return: unit uid's low-cost history is reset
    want = _unit_norms(ref_reg, ref_model, loss_of(ref_model, batch))
    assert torch.allclose(got.grad_low_norm, want, rtol=1e-6, atol=0.0)

    frozen_model, frozen_reg, frozen_backend = _spiked_run(name)
    frozen_backend.apply((), 3)  # never left: the history of steps 1-2 saturates the spike
    frozen = _unit_norms(frozen_reg, frozen_model, loss_of(frozen_model, batch))
    high = got.grad_high_norm[uid]
    assert abs(frozen[uid] - high) > 10 * abs(want[uid] - high)
    assert got.grad_gap[uid] < 0.1 * abs(frozen[uid] - high)


# -------------------------------------------------------------------------- host sync


def test_no_host_sync_in_a_delayed_step(monkeypatch):
    """Forward and backward of a delayed step (full history, a recovered unit measured in
    shadow, error tracking on) never read a tensor on the host."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    backend = EmulatedBackend(low_cost=delayed(amax_history_len=2))
    backend.wrap({0: model[0], 1: model[2]})
    backend.track_errors(2)
    for step in range(1, 5):
        backend.apply((1,) if step == 4 else (), step)
        x = randn(8, 32, seed=step)
        if step == 4:
            with monkeypatch.context() as m:
                for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
                    m.setattr(torch.Tensor, name, _refuse(name))
                model(x).square().sum().backward()
                backend.error_sums(CPU)
        else:
            model(x).square().sum().backward()
    assert float(backend.error_sums(CPU)[1]) > 0.0


def _refuse(name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"host sync: Tensor.{name} called in a delayed step")

    return refuse


def test_histories_live_on_the_parameters_device():
    backend, lin = identity_unit(delayed(amax_history_len=5))
    backend.apply((), 1)
    quantized_input(lin, randn(4, 64, seed=1))
    backend.apply((), 2)
    hist = backend.delayed_scales(lin).w.history
    assert hist.device == lin.weight.device and hist.shape == (5,)
    assert hist.dtype == torch.float32 and float(hist[0]) == 1.0  # amax of I


def test_a_step_applied_again_drops_its_amaxes_and_an_overflow_keeps_the_scale():
    """apply(t) twice (a skipped step run again, evaluation before the step, the probe's
    re-apply): the forwards in between do not enter the history. A step whose amax is inf
    (an overflow) commits the history's own amax instead: the scale stays."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    backend = EmulatedBackend(low_cost=delayed(amax_history_len=4))
    backend.wrap({0: lin})
    hist = backend.delayed_scales(lin).x
    backend.apply((), 1)
    lin(randn(16, 64, seed=1))
    backend.apply((), 2)  # commits step 1
    assert hist.filled == 1
    scale = hist.scale().clone()
    lin(randn(16, 64, seed=2, scale=1e3))  # e.g. an evaluation batch, then the step re-applied
    backend.apply((), 2)
    assert hist.filled == 1 and hist.step_amax is None and torch.equal(hist.scale(), scale)
    x = randn(16, 64, seed=3)
    x[0, 0] = math.inf
    lin(x)
    backend.apply((), 3)  # commits an inf amax: replaced by the history's amax
    assert hist.filled == 2 and torch.equal(hist.scale(), scale)
