"""``megatron_patches``: GNMR for megatron-core, the design card's name for
:mod:`gnmr_dist.integrations.megatron`.

Its public names only (``enable`` / ``disable``, ``enable_loop`` / ``disable_loop``, ``current``,
...), looked up in that package on each use: the objects are the implementation's own, so a
monkeypatch of ``gnmr_dist.integrations.megatron.<module>`` is seen through either name, and
``import megatron_patches`` loads no submodule until a name is used.

A name it exported once (up to issue 32: ``megatron_patches.loop.attach()``, the submodules, the
version table) raises :class:`RemovedNameError`, whose message names what replaced it
(:data:`REMOVED`); ``import megatron_patches.loop`` raises ``ImportError`` with the same message.

The CPU switch (``enable_cpu_compat``, ``disable_cpu_compat``, ``cpu_compat``,
``is_cpu_compat_enabled``, ``cpu_transformer_config``) is test apparatus and lives in
:mod:`gnmr_dist.testing.megatron_cpu`; its names here are deprecated aliases for one release
(:data:`DEPRECATED`), each a ``DeprecationWarning`` naming the new home.
"""

from __future__ import annotations

import warnings
from typing import Any

from gnmr_dist.integrations import megatron as _megatron
from gnmr_dist.integrations.megatron import ATTACH_FROM_ARGV

__all__ = list(_megatron.__all__)


class RemovedNameError(AttributeError):
    """A name ``megatron_patches`` no longer exports; the message names its successor."""


_INTERNAL = "gnmr_dist.integrations.megatron.{}"
_VERSIONS = (
    "the version table is gnmr_dist.integrations.megatron.versions (SERIES, SeriesInfo, "
    'series_info, megatron_series); see docs/megatron.md, "Supported versions"'
)
_CPU = (
    "the CPU switch is gnmr_dist.testing.megatron_cpu.enable_cpu_compat / disable_cpu_compat / "
    "cpu_compat / is_cpu_compat_enabled / cpu_transformer_config "
    "(enable_cpu_compat(training=True) covers Megatron-LM's loop); see docs/megatron.md, "
    '"CPU compatibility"'
)

REMOVED: dict[str, str] = {
    "loop": (
        "megatron_patches.loop is gone: its attach(), which read the --gnmr-* flags from "
        "sys.argv, is attach_from_argv(), and its flag helpers (add_gnmr_args, gnmr_block, "
        "gnmr_namespace, cpu_argv, customary_argv, CPU_FLAGS, CUSTOMARY) are in "
        "gnmr_dist.train.megatron_flags, the drills' (parse_spikes, check_fail_at) in "
        f"gnmr_dist.testing.drills. {ATTACH_FROM_ARGV}"
    ),
    "cpu": f"megatron_patches.cpu is no longer exported: {_CPU}",
    "cpu_training": f"megatron_patches.cpu_training is no longer exported: {_CPU}",
    "gnmr": (
        "megatron_patches.gnmr is no longer exported: use megatron_patches.enable / disable / "
        'current / MegatronGNMR; see docs/megatron.md, "megatron_patches.enable"'
    ),
    "SUPPORTED_MEGATRON_VERSIONS": (
        "megatron_patches.SUPPORTED_MEGATRON_VERSIONS is no longer exported: it is "
        "gnmr_dist.testing.megatron_cpu.SUPPORTED_MEGATRON_VERSIONS (the keys of the "
        f"version table); {_VERSIONS}"
    ),
    **{
        name: f"megatron_patches.{name} is no longer exported: {_VERSIONS}"
        for name in ("versions", "SERIES", "SeriesInfo", "series_info", "megatron_series")
    },
    **{
        name: (
            f"megatron_patches.{name} is no longer exported: it is internal, "
            f"{_INTERNAL.format(name)}; megatron_patches exports enable / enable_loop "
            "(docs/megatron.md)"
        )
        for name in ("attribution", "operators", "session", "te")
    },
}
"""Each name ``megatron_patches`` exported before and no longer does, and what replaced it
(read from the repository's history: ``git log -- megatron_patches``)."""


DEPRECATED = (
    "cpu_compat",
    "cpu_transformer_config",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "is_cpu_compat_enabled",
)
"""The CPU switch's names, exported here up to issue 45 and now in
:mod:`gnmr_dist.testing.megatron_cpu`: aliases with a ``DeprecationWarning`` for one release."""


def _deprecated(name: str) -> Any:
    warnings.warn(
        f"megatron_patches.{name} is deprecated: the CPU stand-ins are test apparatus, now "
        f"gnmr_dist.testing.megatron_cpu.{name}; this alias goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    from gnmr_dist.testing import megatron_cpu  # deprecated bridge, lazily (tests/test_layout.py)

    return getattr(megatron_cpu, name)


def __getattr__(name: str) -> Any:
    """``gnmr_dist.integrations.megatron``'s public ``name`` (or a deprecated alias)."""
    if name in REMOVED:
        raise RemovedNameError(REMOVED[name])
    if name in DEPRECATED:
        return _deprecated(name)
    if name in _megatron.ALIASES:  # apply / remove / attach / detach: they warn when called
        return getattr(_megatron, name)
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_megatron, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
