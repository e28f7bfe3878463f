"""``megatron_patches``: GNMR for megatron-core, the design card's name for
:mod:`gnmr_dist.integrations.megatron`.

Its public names only (``apply``, ``remove``, ``current``, ``attach``, ``detach``, the CPU
switch ``enable_cpu_compat`` / ``disable_cpu_compat`` / ``cpu_compat``, ...), looked up in that
package on each use: the objects are the implementation's own, so a monkeypatch of
``gnmr_dist.integrations.megatron.<module>`` is seen through either name, and ``import
megatron_patches`` loads no submodule until a name is used.
"""

from __future__ import annotations

from typing import Any

from gnmr_dist.integrations import megatron as _megatron

__all__ = list(_megatron.__all__)


def __getattr__(name: str) -> Any:
    """``gnmr_dist.integrations.megatron``'s public ``name``."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_megatron, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
