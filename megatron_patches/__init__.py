"""``megatron_patches``: GNMR for megatron-core, the design card's name for
:mod:`gnmr_dist.integrations.megatron`.

A thin alias: this package and its submodules (``megatron_patches.cpu``, ``.cpu_training``,
``.gnmr``, ``.session``, ``.attribution``, ``.versions``) are the very module objects of
``gnmr_dist.integrations.megatron`` (registered in ``sys.modules``), so
``megatron_patches.apply``, ``megatron_patches.cpu`` and a monkeypatch of either act on the
one implementation.
"""

import sys

from gnmr_dist.integrations import megatron as _megatron
from gnmr_dist.integrations.megatron import *  # noqa: F403  (the public names, __all__)
from gnmr_dist.integrations.megatron import (
    attribution,
    cpu,
    cpu_training,
    gnmr,
    session,
    versions,
)

for _module in (attribution, cpu, cpu_training, gnmr, session, versions):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module

__all__ = list(_megatron.__all__)
