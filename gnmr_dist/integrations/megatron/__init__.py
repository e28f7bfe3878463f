"""The megatron-core integration (imported lazily; this package needs torch only).

Public under its design-card name :mod:`megatron_patches`, a thin alias of this package.

* :mod:`~gnmr_dist.integrations.megatron.cpu`: opt-in CPU compatibility (tests, CPU-only
  hosts); :mod:`~gnmr_dist.integrations.megatron.cpu_training` its ``megatron.training`` part.
* :mod:`~gnmr_dist.integrations.megatron.gnmr`: GNMR in a megatron-core run (``apply`` /
  ``remove``).
* :mod:`~gnmr_dist.integrations.megatron.loop`: GNMR on Megatron-LM's own training loop for any
  pretrain script (``loop.attach()`` before ``pretrain``).
* :mod:`~gnmr_dist.integrations.megatron.versions`: the one table of what differs between
  megatron-core series.
"""

from gnmr_dist.integrations.megatron.cpu import (
    SUPPORTED_MEGATRON_VERSIONS,
    cpu_compat,
    cpu_transformer_config,
    disable_cpu_compat,
    enable_cpu_compat,
    is_cpu_compat_enabled,
)
from gnmr_dist.integrations.megatron.gnmr import MegatronGNMR, apply, current, remove
from gnmr_dist.integrations.megatron.versions import (
    SERIES,
    SeriesInfo,
    megatron_series,
    series_info,
)

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
