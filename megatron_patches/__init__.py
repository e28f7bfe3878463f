"""``megatron_patches``: GNMR for megatron-core, the design card's name for
:mod:`gnmr_dist.integrations.megatron`.

Plain re-exports of that package's public names, and its submodules as attributes
(``megatron_patches.loop.attach()``, ``megatron_patches.cpu``): the objects are the
implementation's own, so a monkeypatch of ``gnmr_dist.integrations.megatron.<module>`` is seen
through either name. ``import megatron_patches`` is the one import; write
``megatron_patches.loop.attach()``, not ``import megatron_patches.loop``.
"""

from gnmr_dist.integrations.megatron import (
    SERIES,
    SUPPORTED_MEGATRON_VERSIONS,
    MegatronGNMR,
    SeriesInfo,
    apply,
    attribution,
    cpu,
    cpu_compat,
    cpu_transformer_config,
    current,
    disable_cpu_compat,
    enable_cpu_compat,
    gnmr,
    is_cpu_compat_enabled,
    loop,
    megatron_series,
    operators,
    remove,
    series_info,
    session,
    te,
    versions,
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
