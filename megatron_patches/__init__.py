"""Patches for megatron-core (imported lazily; this package needs torch only).

* :mod:`megatron_patches.cpu`: opt-in CPU compatibility (tests, CPU-only hosts).
* :mod:`megatron_patches.gnmr`: GNMR in a megatron-core run (``apply`` / ``remove``).
"""

from megatron_patches.cpu import (
    SUPPORTED_MEGATRON_VERSIONS,
    cpu_compat,
    cpu_transformer_config,
    disable_cpu_compat,
    enable_cpu_compat,
    is_cpu_compat_enabled,
)
from megatron_patches.gnmr import (
    FUSED_NORM_VERSIONS,
    MegatronGNMR,
    apply,
    current,
    megatron_series,
    remove,
)

__all__ = [
    "FUSED_NORM_VERSIONS",
    "SUPPORTED_MEGATRON_VERSIONS",
    "MegatronGNMR",
    "apply",
    "cpu_compat",
    "cpu_transformer_config",
    "current",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "is_cpu_compat_enabled",
    "megatron_series",
    "remove",
]
