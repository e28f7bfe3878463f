"""``gnmr_dist.deepspeed.initialize``: DeepSpeed with the ``"gnmr"`` config block.

Imports DeepSpeed only when :func:`initialize` is called.
"""

from gnmr_dist.integrations.deepspeed import (
    DeepSpeedGNMR,
    disable,
    enable,
    enabled,
    initialize,
    is_enabled,
    load_ds_config,
)

__all__ = [
    "DeepSpeedGNMR",
    "disable",
    "enable",
    "enabled",
    "initialize",
    "is_enabled",
    "load_ds_config",
]
