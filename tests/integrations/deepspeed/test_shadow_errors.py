"""The shadow error route under real DeepSpeed ZeRO-2, 2 ranks over gloo, CPU.

1. ``fp8_emulated`` on a Llama: the shadow route, given the backend's own quantization and fed
   from forward hooks on the wrapped projections (the operands the module is handed, as it is fed
   for Transformer Engine's modules), sums what the backend sums inside its GEMMs, bit for bit, on
   every rank, over three steps of two micro-batches, low-cost and recovered units alike.
2. ``te_fp8`` with ``gamma``: the Llama's projections are Transformer Engine ``Linear`` stand-ins
   (``tests/backends/te_stand_ins.py``: the module type and TE's regions; the numbers are the
   shadow route's own). Only ``e`` can select (``alpha``, ``beta`` out of reach), and the
   runtime's ``check_consistency`` compares every decision's digest across the ranks.
"""

from __future__ import annotations

import pytest
import torch

from tests import multiproc
from tests.integrations.deepspeed import common as dsc
from tests.requires import require

require("deepspeed")

GAS = 2
STEPS = 3
E_ONLY = {"alpha": 100.0, "beta": 100.0, "warmup_steps": 0, "max_active": 3, "lock_steps": 1}


def _train(engine, rank, on_boundary):
    for step in range(STEPS):
        for m in range(GAS):
            tokens = dsc.batch(10 * step + m, rank)
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)  # in step_context()
        on_boundary(step)
        engine.step()


def _emulated_worker(rank, world):
    import gnmr_dist.deepspeed as gds
    from gnmr_dist.backends import LOW_COST
    from gnmr_dist.backends.error_sums import ErrorSums
    from gnmr_dist.backends.shadow import ShadowRoute, SpecRecipe

    dsc.no_shm_build()
    block = dsc.gnmr_block(backend="fp8_emulated", gamma=0.05, **E_ONLY)
    block["low_cost"] = {"grad_format": "e5m2"}
    cfg = dsc.ds_config(2, "fp32", block, gradient_accumulation_steps=GAS)
    engine, *_ = gds.initialize(model=dsc.llama(), config=cfg)
    backend = engine.gnmr.backend
    sink = ErrorSums(engine.gnmr.registry.num_units)
    route = ShadowRoute(SpecRecipe(backend.specs[LOW_COST]))
    seen = {"step": None}

    def hook_for(uid):
        def hook(module, args, out):
            if seen["step"] != backend._step:  # the backend's apply started a step
                seen["step"] = backend._step
                sink.reset()
            if torch.is_grad_enabled():
                route.measure(sink, uid, args[0], out)

        return hook

    for uid, modules in backend._wrapped.items():
        for module in modules:
            module.register_forward_hook(hook_for(uid))
    out = []

    def compare(step):
        cpu = torch.device("cpu")
        out.append((backend.error_sums(cpu), sink.total(cpu), sorted(backend.report().recovered)))

    _train(engine, rank, compare)
    return out


def _te_worker(rank, world):
    import sys

    import gnmr_dist.deepspeed as gds
    from tests.backends.te_stand_ins import build_fake_te

    dsc.no_shm_build()
    modules, _ = build_fake_te()
    sys.modules.update(modules)
    te = modules["transformer_engine.pytorch"]
    model = dsc.llama()
    for name, lin in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in dsc.PROJ:
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            stand_in = te.Linear(lin.in_features, lin.out_features)
            with torch.no_grad():
                stand_in.weight.copy_(lin.weight)
                stand_in.bias.zero_()
            setattr(parent, name.rsplit(".", 1)[-1], stand_in)
    block = dsc.gnmr_block(backend="te_fp8", gamma=0.02, error_every=1, **E_ONLY)
    block["low_cost"] = {"recipe": "tensorwise"}  # (its default interval, 50, is past 3 steps)
    cfg = dsc.ds_config(2, "fp32", block, gradient_accumulation_steps=GAS)
    engine, *_ = gds.initialize(model=model, config=cfg)
    _train(engine, rank, lambda step: None)
    decision = engine.gnmr.last_decision
    return {
        "names": engine.gnmr.registry.names,
        "error": decision.error,
        "active": decision.active,
        "recovered": engine.gnmr.runtime.summary().as_dict(engine.gnmr.registry.names),
    }


@pytest.mark.slow
def test_shadow_route_under_zero2_equals_emulated_and_te_fp8_decides_alike_on_every_rank():
    emulated, te = multiproc.run_jobs([(_emulated_worker, 2, ()), (_te_worker, 2, ())])
    for rank in emulated:
        for own, shadow, _ in rank:
            assert (own > 0).all() and torch.equal(own, shadow)
    assert any(recovered for _, _, recovered in emulated[0][1:])  # measured while recovered
    a, b = te
    assert a["names"] == tuple(dsc.unit_names())
    assert torch.equal(a["error"], b["error"]) and a["active"] == b["active"]
    assert (a["error"] > 0).all() and a["active"]  # e (the shadow's) selected units
    assert a["recovered"] == b["recovered"]
