"""``megatron_patches``: GNMR for megatron-core, the design card's name for
:mod:`gnmr_dist.integrations.megatron`.

A thin alias: ``megatron_patches`` and its submodules (``.cpu``, ``.cpu_training``, ``.gnmr``,
``.loop``, ``.session``, ``.attribution``, ``.versions``) are the very module objects of
``gnmr_dist.integrations.megatron`` (registered in ``sys.modules``), so
``megatron_patches.apply``, ``megatron_patches.cpu`` and a monkeypatch of either act on the
one implementation, whichever name the caller imported.
"""

import sys

from gnmr_dist.integrations import megatron as _megatron
from gnmr_dist.integrations.megatron import (
    attribution,
    cpu,
    cpu_training,
    gnmr,
    loop,
    session,
    versions,
)

for _module in (attribution, cpu, cpu_training, gnmr, loop, session, versions):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
sys.modules[__name__] = _megatron  # `import megatron_patches` yields the package itself
