"""The recovery-gap probe against an explicit two-pass reference, and what it must leave alone.

The reference trains nothing: two deep copies of one small model, one with the backend's
low-cost path on every unit and one with its recovery path on every unit, each an ordinary
``loss.backward()``; per-unit norms of the ``.grad`` differences, in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gnmr_dist.backends import get_backend
from gnmr_dist.distributed import UnitRegistry
from gnmr_dist.distributed.probe import RecoveryProbe
from tests import multiproc

VOCAB, HIDDEN, FFN = 32, 16, 48

PATHS = {
    "act_quant": ({"bits": 2, "group_size": 8}, {"bits": 8, "group_size": 8}),
    "fp8_emulated": ({"format": "e3m2", "granularity": "tensor"}, {"format": "bf16"}),
}


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, layers: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(dropout) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_net(seed=0, dtype=torch.float32, dropout=0.0):
    torch.manual_seed(seed)
    return Net(dropout=dropout).to(dtype)


def tokens(n=6, seq=10, seed=1):
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def loss_of(model, batch, scale=1.0):
    logits = model(batch[:, :-1])
    return scale * nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def wrapped(model, name):
    """(registry, backend) with every unit of ``model`` wrapped (as the harness does)."""
    registry = UnitRegistry.from_model(model)
    low, high = PATHS[name]
    backend = get_backend(name, low_cost=low, recovery=high)
    backend.wrap(registry.local_modules)
    return registry, backend


def reference_grads(model, name, batch, recover_all):
    """Per-parameter ``.grad`` of a deep copy with every unit on one path (ordinary backward)."""
    twin = copy.deepcopy(model)
    registry, backend = wrapped(twin, name)
    backend.apply(range(registry.num_units) if recover_all else (), step=1)
    twin.zero_grad(set_to_none=True)
    loss = loss_of(twin, batch)
    loss.backward()
    return registry, [p.grad.double() for p in registry.params], float(loss.detach())


def unit_norms(registry, tensors):
    out = torch.zeros(registry.num_units, dtype=torch.float64)
    for t, s in zip(tensors, registry.param_slots.tolist(), strict=True):
        if s < registry.num_units:
            out[s] += t.double().square().sum()
    return out.sqrt()


def reference_gaps(model, name, batch, denominators=None):
    """(grad gap, update gap, low norm, high norm, low loss, high loss) by the two twins."""
    reg, low, loss_low = reference_grads(model, name, batch, recover_all=False)
    _, high, loss_high = reference_grads(model, name, batch, recover_all=True)
    diff = [a - b for a, b in zip(low, high, strict=True)]
    if denominators is None:
        scaled = diff
    else:
        scaled = [d / denominators(i, h) for i, (d, h) in enumerate(zip(diff, high, strict=True))]
    return (
        unit_norms(reg, diff),
        unit_norms(reg, scaled),
        unit_norms(reg, low),
        unit_norms(reg, high),
        loss_low,
        loss_high,
    )


def assert_rel(got, want, rel=1e-6):
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert torch.allclose(got, want, rtol=rel, atol=0), (got, want)


@pytest.mark.parametrize("name", sorted(PATHS))
def test_grad_gap_equals_the_two_pass_reference(name):
    model, batch = make_net(), tokens()
    want = reference_gaps(model, name, batch)
    registry, backend = wrapped(model, name)
    backend.apply({1, 4}, step=3)  # the step's own plan: neither of the probe's
    got = RecoveryProbe(registry, backend).measure(lambda: loss_of(model, batch))
    assert registry.num_units == 6 and got.step == 3
    assert_rel(got.grad_gap, want[0])
    assert_rel(got.grad_low_norm, want[2])
    assert_rel(got.grad_high_norm, want[3])
    assert torch.equal(got.update_gap, got.grad_gap)  # no optimizer: no normalisation
    assert (got.loss_low, got.loss_high) == pytest.approx(want[4:], rel=1e-6)
    # the paths really differ on every unit, and the gap is a small part of the gradient
    assert bool((got.grad_gap > 0).all())
    assert bool((got.grad_gap < got.grad_high_norm).all())


def adam_reference_denominator(opt):
    """``sqrt(exp_avg_sq / (1 - beta2^step)) + eps``, parameter by parameter, from the state."""
    (group,) = opt.param_groups
    beta2, eps = group["betas"][1], group["eps"]

    def den(param):
        state = opt.state[param]
        v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** int(state["step"]))
        return v_hat.sqrt() + eps

    return den


@pytest.mark.parametrize("name", sorted(PATHS))
def test_update_gap_equals_the_reference_after_two_adamw_steps(name):
    model, batch = make_net(), tokens()
    registry, backend = wrapped(model, name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
    for step in (1, 2):
        backend.apply({step}, step=step)
        opt.zero_grad()
        loss_of(model, tokens(seed=10 + step)).backward()
        opt.step()
    weights = unwrapped_plain(copy.deepcopy(model))  # the same weights, for the twins
    backend.apply((), step=3)
    got = RecoveryProbe(registry, backend, opt).measure(lambda: loss_of(model, batch))
    den = adam_reference_denominator(opt)
    params = registry.params
    want = reference_gaps(weights, name, batch, denominators=lambda i, _: den(params[i]))
    assert_rel(got.grad_gap, want[0])
    assert_rel(got.update_gap, want[1])
    assert int(opt.state[params[0]]["step"]) == 2
    # Adam's scaling reorders the units: the update gap is not a multiple of the grad gap
    ratio = got.update_gap / got.grad_gap
    assert float(ratio.max() / ratio.min()) > 1.5


def unwrapped_plain(model):
    """A deep copy of a wrapped model carries the instance-level forwards: drop them."""
    for module in model.modules():
        vars(module).pop("forward", None)
    return model


def test_update_gap_on_the_first_step_is_adams_first_step():
    model, batch = make_net(), tokens()
    twin = copy.deepcopy(model)
    registry, backend = wrapped(model, "act_quant")
    opt = torch.optim.Adam(model.parameters(), eps=1e-5)
    backend.apply((), step=1)
    got = RecoveryProbe(registry, backend, opt).measure(lambda: loss_of(model, batch))
    # empty state: v_hat = g_high^2, so the update gap is ||(g_low - g_high) / (|g_high| + eps)||
    want = reference_gaps(twin, "act_quant", batch, denominators=lambda i, h: h.abs() + 1e-5)
    assert_rel(got.update_gap, want[1])
    assert not opt.state  # the probe never writes the optimizer's state
    # an optimizer without Adam's second moment does not normalise
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = RecoveryProbe(registry, backend, sgd).measure(lambda: loss_of(model, batch))
    assert torch.equal(plain.update_gap, plain.grad_gap)


def accumulate_grad_node(param):
    return param.view_as(param).grad_fn.next_functions[0][0]


def test_measure_leaves_grads_hooks_plan_report_and_rng_as_they_were():
    model, batch = make_net(dropout=0.2), tokens()
    registry, backend = wrapped(model, "act_quant")
    twin = copy.deepcopy(model)  # the same step without a probe
    twin_registry, twin_backend = wrapped(unwrapped_plain(twin), "act_quant")
    params = list(model.parameters())
    for i, p in enumerate(params):  # some stale gradients, some None
        p.grad = torch.randn_like(p) if i % 2 else None
    before_grads = [None if p.grad is None else p.grad.clone() for p in params]
    calls = []
    nodes = [accumulate_grad_node(p) for p in params]  # keep the nodes (and their hooks) alive
    for p, node in zip(params, nodes, strict=True):
        p.register_post_accumulate_grad_hook(lambda t: calls.append("post-accumulate"))
        node.register_hook(lambda *a: calls.append("AccumulateGrad"))
    backend.apply({0, 5}, step=7)
    report, paths = backend.report(), [backend.path_of(u) for u in range(6)]
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    RecoveryProbe(registry, backend).measure(lambda: loss_of(model, batch))
    assert calls == []
    assert all(
        (b is None and p.grad is None) or torch.equal(b, p.grad)
        for b, p in zip(before_grads, params, strict=True)
    )
    assert backend.report() == report and report.ran == {}
    assert [backend.path_of(u) for u in range(6)] == paths
    assert torch.equal(torch.get_rng_state(), rng)
    # the step that follows is the step without a probe, bit for bit (same dropout masks)
    model.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()
    twin_backend.apply({0, 5}, step=7)
    torch.manual_seed(123)
    loss_of(twin, batch).backward()
    assert all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(registry.params, twin_registry.params, strict=True)
    )
    assert backend.report() == twin_backend.report()
    # the hooks are live: the step's own backward ran them, once per parameter
    assert calls.count("post-accumulate") == calls.count("AccumulateGrad") == len(params)


def test_both_passes_draw_the_same_dropout_masks():
    model, batch = make_net(dropout=0.5), tokens()
    registry = UnitRegistry.from_model(model)
    same = {"bits": 32, "group_size": 8}  # both paths exact: any gap is the RNG's
    backend = get_backend("act_quant", low_cost=same, recovery=same)
    backend.wrap(registry.local_modules)
    backend.apply((), step=1)
    got = RecoveryProbe(registry, backend).measure(lambda: loss_of(model, batch))
    assert torch.equal(got.grad_gap, torch.zeros(6, dtype=torch.float64))
    assert got.loss_low == got.loss_high
    # without the RNG reset two passes would differ: the check above has teeth
    a = torch.autograd.grad(loss_of(model, batch), registry.params)
    b = torch.autograd.grad(loss_of(model, batch), registry.params)
    assert not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_measure_refuses_once_the_step_has_run_a_forward():
    model, batch = make_net(), tokens()
    registry, backend = wrapped(model, "act_quant")
    backend.apply({2}, step=4)
    loss_of(model, batch)
    report = backend.report()
    with pytest.raises(RuntimeError, match="before the step's own forward"):
        RecoveryProbe(registry, backend).measure(lambda: loss_of(model, batch))
    assert backend.report() == report  # nothing was touched


@pytest.mark.parametrize("reentrant", [True, False])
def test_reentrant_checkpointing_is_refused_not_read_as_zero_gaps(reentrant):
    """``torch.autograd.grad`` cannot reach parameters inside a reentrant checkpoint: the probe
    says so instead of reporting gaps of 0 for those units; the non-reentrant form works."""
    from torch.utils.checkpoint import checkpoint

    model, batch = make_net(), tokens()
    registry, backend = wrapped(model, "act_quant")
    inner = model.layers[1].forward
    model.layers[1].forward = lambda x: checkpoint(inner, x, use_reentrant=reentrant)
    backend.apply((), step=1)
    probe = RecoveryProbe(registry, backend)
    closure = lambda: loss_of(model, batch)  # noqa: E731
    if reentrant:
        with pytest.raises(RuntimeError, match=r"use_reentrant=False"):
            probe.measure(closure)
    else:
        assert bool((probe.measure(closure).grad_gap > 0).all())


def test_frozen_parameters_are_not_differentiated():
    model, batch = make_net(), tokens()
    registry, backend = wrapped(model, "act_quant")
    for p in model.layers[1].parameters():
        p.requires_grad_(False)
    backend.apply((), step=1)
    got = RecoveryProbe(registry, backend).measure(lambda: loss_of(model, batch))
    frozen = [registry.index[f"layers.1.{op}"] for op in ("fc1", "fc2")]
    assert got.grad_gap[frozen].tolist() == [0.0, 0.0]
    assert bool((got.grad_gap[[0, 1, 4, 5]] > 0).all())


# ---------------------------------------------------------------------------- distributed


def _probe_worker(rank, world):
    model, batch = make_net(dtype=torch.float64), tokens(n=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, batch).backward()  # one step on the full batch: the same state everywhere
    opt.step()
    model.zero_grad(set_to_none=True)
    shard = batch.chunk(world)[rank]
    # data parallel: each rank the gradient of its half; the probe sums them, so the loss is
    # the local mean scaled by local batch / global batch
    registry, backend = wrapped(model, "act_quant")
    backend.apply((), step=2)
    dp = RecoveryProbe(registry, backend, opt, dp_group=dist.group.WORLD).measure(
        lambda: loss_of(model, shard, scale=len(shard) / len(batch))
    )
    # split gradients (pipeline-like): each rank counts the units of its own layers; the
    # sums of squares add over the group
    mine = "layers.0.*" if rank == 0 else "layers.[12].*"
    split = UnitRegistry.from_model(model, include=[mine], group=dist.group.WORLD)
    assert split.names == registry.names
    sp = RecoveryProbe(split, backend, opt, group=dist.group.WORLD).measure(
        lambda: loss_of(model, batch)
    )
    # the wrong group for replicas: adding the halves' squared gaps is not the averaged gap
    naive = RecoveryProbe(registry, backend, opt, group=dist.group.WORLD).measure(
        lambda: loss_of(model, shard, scale=len(shard) / len(batch))
    )
    return dp, sp, naive, [p.grad for p in model.parameters()]


@pytest.mark.slow
def test_data_parallel_and_split_gradients_give_the_single_process_gaps():
    model, batch = make_net(dtype=torch.float64), tokens(n=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, batch).backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    registry, backend = wrapped(model, "act_quant")
    backend.apply((), step=2)
    want = RecoveryProbe(registry, backend, opt).measure(lambda: loss_of(model, batch))
    results = multiproc.run(_probe_worker, 2)
    for dp, sp, naive, grads in results:
        for got in (dp, sp):
            for field in ("grad_gap", "update_gap", "grad_low_norm", "grad_high_norm"):
                assert_rel(getattr(got, field), getattr(want, field))
        assert all(g is None for g in grads)
        assert not torch.allclose(naive.grad_gap, want.grad_gap, rtol=1e-3)
    for field in ("grad_gap", "update_gap"):  # bit-identical on every rank
        assert torch.equal(getattr(results[0][0], field), getattr(results[1][0], field))
