"""Patches for megatron-core (imported lazily; this package needs torch only).

* :mod:`megatron_patches.cpu`: opt-in CPU compatibility (tests, CPU-only hosts).
* :mod:`megatron_patches.gnmr`: GNMR in a megatron-core run (``apply`` / ``remove``).
* :mod:`megatron_patches.versions`: the one table of what differs between megatron-core series.
"""

from megatron_patches.cpu import (
    SUPPORTED_MEGATRON_VERSIONS,
    cpu_compat,
    cpu_transformer_config,
    disable_cpu_compat,
    enable_cpu_compat,
    is_cpu_compat_enabled,
)
from megatron_patches.gnmr import MegatronGNMR, apply, current, remove
from megatron_patches.versions import SERIES, SeriesInfo, megatron_series, series_info

__all__ = [
    "SERIES",
    "SUPPORTED_MEGATRON_VERSIONS",
    "MegatronGNMR",
    "SeriesInfo",
    "apply",
    "cpu_compat",
    "cpu_transformer_config",
    "current",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "is_cpu_compat_enabled",
    "megatron_series",
    "remove",
    "series_info",
]
