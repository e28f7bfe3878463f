"""Compatibility patches for megatron-core (imported lazily; this package needs torch only)."""

from megatron_patches.cpu import (
    SUPPORTED_MEGATRON_VERSIONS,
    cpu_compat,
    cpu_transformer_config,
    disable_cpu_compat,
    enable_cpu_compat,
    is_cpu_compat_enabled,
)

__all__ = [
    "SUPPORTED_MEGATRON_VERSIONS",
    "cpu_compat",
    "cpu_transformer_config",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "is_cpu_compat_enabled",
]
