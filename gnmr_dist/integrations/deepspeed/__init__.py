"""The DeepSpeed integration: every DeepSpeed (and Hugging Face Trainer) fact of gnmr-dist.

Public as :mod:`gnmr_dist.deepspeed`. Imports DeepSpeed only when an engine is built.

* :mod:`~gnmr_dist.integrations.deepspeed.engine`: ``initialize`` / ``enable`` / ``disable``,
  the ``"gnmr"`` block read from a DeepSpeed config, the settings refused at start.
* :mod:`~gnmr_dist.integrations.deepspeed.session`: GNMR around one engine (the step hooks, the
  state file in DeepSpeed's checkpoints, the recovery-gap probe).
* :mod:`~gnmr_dist.integrations.deepspeed.grads`: where each ZeRO stage keeps a gradient.
* :mod:`~gnmr_dist.integrations.deepspeed.trainer`: ``GNMRCallback`` for Hugging Face Trainer.
"""

from gnmr_dist.integrations.deepspeed import engine as _engine
from gnmr_dist.integrations.deepspeed.engine import *  # noqa: F403 (the re-export is the point)

__all__ = list(_engine.__all__)
