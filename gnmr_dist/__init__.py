"""gnmr-dist: a run-time stability controller for low-precision LLM training.

GNMR (Gradient Norm-to-Mean Ratio) scores every unit's gradient norm against its own history and
switches a budget of at most ``max_active`` riskiest units to a higher-fidelity recovery path for
the next step. ``import gnmr_dist`` needs torch alone; the DeepSpeed, Megatron-core and
Transformer Engine parts load only when used. ``gnmr_dist.GNMRCallback`` (Hugging Face Trainer)
imports transformers when it is first named.

Importing ``gnmr_dist`` installs one import hook: a finder at the front of ``sys.meta_path``
that answers for the ``deepspeed`` module alone and, once DeepSpeed's module has run, wraps
``DeepSpeedEngine.__init__`` (at once when DeepSpeed is imported already) and leaves
``sys.meta_path``. The wrapper builds every engine unchanged and warns once per process when its
config holds an enabled ``"gnmr"`` block that no GNMR code read (plain ``deepspeed.initialize``,
a Trainer without ``GNMRCallback``): DeepSpeed ignores unknown keys, so that run would train
without GNMR and without a word (:mod:`gnmr_dist.integrations.ds_watch`, docs/deepspeed.md,
"Nothing silent"). It imports nothing and changes nothing else.
"""

from typing import Any

from gnmr_dist.core import Decision, GNMRConfig, GNMRController, Schedule, Telemetry
from gnmr_dist.integrations import ds_watch

ds_watch.arm()  # an enabled "gnmr" block handed to plain deepspeed.initialize is said once

__version__ = "0.1.0"

__all__ = [
    "Decision",
    "GNMRCallback",
    "GNMRConfig",
    "GNMRController",
    "Schedule",
    "Telemetry",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """``GNMRCallback`` on first use (it subclasses transformers' ``TrainerCallback``)."""
    if name == "GNMRCallback":
        from gnmr_dist.integrations.deepspeed.trainer import GNMRCallback

        return GNMRCallback
    raise AttributeError(f"module 'gnmr_dist' has no attribute {name!r}")
