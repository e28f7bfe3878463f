"""The registered backends (``gnmr_dist.backends.BACKENDS``) as pytest parameters.

The backend contract tests parametrize over these, so a new backend (one module plus one
registry line) is tested by them without editing them. A backend that cannot be built on this
host (``te_fp8`` without Transformer Engine and CUDA) or that does not switch ``nn.Linear``, the
operator of the contract tests' models, is skipped with the reason; its own tests cover it.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from gnmr_dist.backends import BACKENDS, backend_class, get_backend


def _skip_reason(name: str) -> str | None:
    """Why the contract tests cannot run ``name`` here, or ``None``."""
    try:
        backend = get_backend(name)
    except (ImportError, RuntimeError) as err:  # a missing optional package or device
        first = str(err).split("; ")[0].split(". ")[0]
        return f"backend {name!r} cannot be built on this host ({type(err).__name__}: {first})"
    if not backend.supports(nn.Linear(8, 8)):
        return f"backend {name!r} does not switch nn.Linear (its own tests cover its modules)"
    return None


def backend_params(*, reports_errors: bool | None = None) -> list[Any]:
    """One ``pytest.param(name)`` per registered backend, in name order (``reports_errors``:
    only those whose class says so), skipped with the reason where it cannot run here."""
    params = []
    for name in sorted(BACKENDS):
        if reports_errors is not None and backend_class(name).reports_errors != reports_errors:
            continue
        reason = _skip_reason(name)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params
