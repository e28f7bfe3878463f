"""The megatron-core integration: every megatron-core and Megatron-LM fact of gnmr-dist.

Public under its design-card name :mod:`megatron_patches`. The package exports its public names
only and imports each submodule when one of its names is first used (module ``__getattr__``),
so importing it loads neither megatron nor the backends:

* ``enable`` / ``disable`` / ``current`` / ``MegatronGNMR``
  (:mod:`~gnmr_dist.integrations.megatron.gnmr`): GNMR in a megatron-core run your own loop
  drives (``enable`` returns the run's handle, also a context manager);
* ``enable_loop`` / ``disable_loop`` (:mod:`~gnmr_dist.integrations.megatron.loop`): GNMR on
  Megatron-LM's own training loop (``megatron.training.pretrain``), the same verb pair;
* ``Reporter`` (:mod:`~gnmr_dist.integrations.megatron.report`): the trace, ``gnmr/*`` scalars
  through megatron's writers, the console line and the end-of-run accounting, which ``enable_loop``
  drives from ``training_log`` and a loop of its own calls after each ``optimizer.step()``.

The CPU stand-ins for megatron-core (``enable_cpu_compat`` and friends) are test apparatus, in
:mod:`gnmr_dist.testing.megatron_cpu`, not among these names.

Inside: :mod:`~gnmr_dist.integrations.megatron.operators` (megatron's operators as the backends
see them, its parameter marks), :mod:`~gnmr_dist.integrations.megatron.te` (a TE linear's
``te_quant_params`` switch), :mod:`~gnmr_dist.integrations.megatron.attribution` (gradient
attribution), :mod:`~gnmr_dist.integrations.megatron.session` (GNMR around one run) and
:mod:`~gnmr_dist.integrations.megatron.versions` (what differs between megatron-core series).
"""

from __future__ import annotations

import importlib
from typing import Any

ATTACH_FROM_ARGV = (
    "GNMR on Megatron-LM's loop from the command line is `from gnmr_dist.train.megatron_flags "
    "import attach_from_argv` and `extra_args_provider = attach_from_argv()` before "
    "`pretrain(..., extra_args_provider=extra_args_provider)` (a provider of your own: "
    "`attach_from_argv(mine)`); `megatron_patches.enable_loop(block)` attaches a block your script "
    'has read itself. See docs/megatron.md, "Megatron-LM\'s training loop"'
)
"""The pointer every refusal of the old command-line attachment gives (``megatron_patches.loop
.attach()`` up to issue 32, ``attach()`` without a block)."""

_HOMES = {
    "MegatronGNMR": "gnmr",
    "Reporter": "report",
    "enable": "gnmr",
    "current": "gnmr",
    "disable": "gnmr",
    "enable_loop": "loop",
    "disable_loop": "loop",
}
"""Each public name and the submodule that defines it."""

__all__ = sorted(_HOMES)

ALIASES = {"apply": "gnmr", "remove": "gnmr", "attach": "loop", "detach": "loop"}
"""The verbs of earlier releases, deprecated aliases of ``enable`` / ``disable`` and
``enable_loop`` / ``disable_loop`` for one release (a ``DeprecationWarning`` on each call)."""


def __getattr__(name: str) -> Any:
    """A public name, from its submodule (imported on first use)."""
    home = _HOMES.get(name) or ALIASES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
