"""The guard the GPU test modules open with: a CUDA GPU and Transformer Engine, else the whole
module is skipped with the reason (TE cannot be installed without CUDA)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def require_cuda_and_te() -> tuple[ModuleType, ModuleType]:
    """Skip the importing test module unless CUDA and TE are there; TE's ``pytorch`` module and
    its ``recipe`` module."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except Exception as err:  # TE's import fails with OSError/RuntimeError too without its libs
        pytest.skip(f"needs Transformer Engine ({err})", allow_module_level=True)
    return te, te_recipe
