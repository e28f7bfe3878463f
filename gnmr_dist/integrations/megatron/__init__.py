"""The megatron-core integration: every megatron-core and Megatron-LM fact of gnmr-dist
(megatron is imported lazily; importing this package needs torch only).

Public under its design-card name :mod:`megatron_patches` (plain re-exports of this package).

* :mod:`~gnmr_dist.integrations.megatron.operators`: megatron's operators, as the backends see
  them (the tensor-parallel forward adapter, the TE linears), and its parameter marks.
* :mod:`~gnmr_dist.integrations.megatron.te`: a megatron TE linear's own ``te_quant_params``
  switch, for the ``te_fp8`` backend.
* :mod:`~gnmr_dist.integrations.megatron.cpu`: opt-in CPU stand-ins (tests, CPU-only hosts),
  split by what they stand in for; :mod:`~gnmr_dist.integrations.megatron.cpu.training` its
  ``megatron.training`` part.
* :mod:`~gnmr_dist.integrations.megatron.gnmr`: GNMR in a megatron-core run (``apply`` /
  ``remove``).
* :mod:`~gnmr_dist.integrations.megatron.loop`: GNMR on Megatron-LM's own training loop for any
  pretrain script (``loop.attach()`` before ``pretrain``).
* :mod:`~gnmr_dist.integrations.megatron.versions`: the one table of what differs between
  megatron-core series.
"""

from gnmr_dist.integrations.megatron import (
    attribution,
    cpu,
    gnmr,
    loop,
    operators,
    session,
    te,
    versions,
)
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
    "attribution",
    "cpu",
    "cpu_compat",
    "cpu_transformer_config",
    "current",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "gnmr",
    "is_cpu_compat_enabled",
    "loop",
    "megatron_series",
    "operators",
    "remove",
    "series_info",
    "session",
    "te",
    "versions",
]
