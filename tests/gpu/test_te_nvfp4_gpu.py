"""te_fp8 with NVFP4 on a GPU: refused by name without FP4 GEMMs, TE's own NVFP4 where it runs.

    pytest -m gpu tests/gpu -q

Skipped as a whole without CUDA or Transformer Engine. On a GPU of compute capability below
10.0 (Hopper: H100, H200) the refusal is checked; on Blackwell, a stack of ``te.Linear`` under
the backend with an empty plan equals plain ``autocast(recipe=NVFP4BlockScaling())`` on the
forward (the backward rounds stochastically), and a recovered unit runs BF16.
"""

from __future__ import annotations

import pytest
import torch

from gnmr_dist.backends.te_fp8 import TEFp8Backend
from tests.gpu.te_guard import require_cuda_and_te

pytestmark = pytest.mark.gpu

te, te_recipe = require_cuda_and_te()

CAPABILITY = torch.cuda.get_device_capability()
NAME = torch.cuda.get_device_name()
D, TOKENS = 1024, 2048


@pytest.mark.skipif(CAPABILITY >= (10, 0), reason="this GPU has FP4 GEMMs")
def test_nvfp4_is_refused_naming_this_gpu_and_te_state_stays_off():
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    with pytest.raises(RuntimeError) as err:
        TEFp8Backend(low_cost={"recipe": "nvfp4"})
    message = str(err.value)
    assert NAME in message and f"{CAPABILITY[0]}.{CAPABILITY[1]}" in message
    assert "fp8_emulated" in message
    assert not FP8GlobalStateManager.is_fp8_enabled()


@pytest.mark.skipif(CAPABILITY < (10, 0), reason="needs FP4 GEMMs (compute capability 10.0+)")
def test_nvfp4_forward_equals_plain_te_and_a_recovered_unit_runs_bf16():
    torch.manual_seed(0)
    stack = torch.nn.ModuleList(
        te.Linear(D, D, params_dtype=torch.bfloat16, device="cuda") for _ in range(3)
    )
    x = torch.randn(TOKENS, D, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad(), te.autocast(enabled=True, recipe=te_recipe.NVFP4BlockScaling()):
        plain = stack[1](stack[0](x))
    backend = TEFp8Backend(low_cost={"recipe": "nvfp4"})
    backend.wrap(dict(enumerate(stack)))
    backend.apply(set(), step=1)
    with torch.no_grad(), backend.autocast():
        ours = stack[1](stack[0](x))
    assert torch.equal(ours, plain)
    backend.apply({1}, step=2)
    with torch.no_grad(), backend.autocast():
        y0 = stack[0](x)
        y1 = stack[1](y0)
    with torch.no_grad():
        bf16 = stack[1](y0)
    assert torch.equal(y1, bf16) and not backend.fp8_ran(1) and backend.fp8_ran(0)
