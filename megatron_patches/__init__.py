"""``megatron_patches``: GNMR for megatron-core, the design card's name for
:mod:`gnmr_dist.integrations.megatron`.

Plain re-exports of that package's public names (its ``__all__``: ``apply``, ``remove``,
``enable_cpu_compat``, ...) and of its submodules as attributes (``megatron_patches.loop.attach()``,
``megatron_patches.cpu``): the objects are the implementation's own, so a monkeypatch of
``gnmr_dist.integrations.megatron.<module>`` is seen through either name. ``import
megatron_patches`` is the one import; write ``megatron_patches.loop.attach()``, not
``import megatron_patches.loop``.
"""

from gnmr_dist.integrations import megatron as _megatron
from gnmr_dist.integrations.megatron import *  # noqa: F403 (the re-export is the point)

__all__ = list(_megatron.__all__)
