"""gnmr-dist: a run-time stability controller for low-precision LLM training.

GNMR (Gradient Norm-to-Mean Ratio) scores every unit's gradient norm against its own history and
switches a budget of at most ``max_active`` riskiest units to a higher-fidelity recovery path for
the next step. ``import gnmr_dist`` needs torch alone; the DeepSpeed, Megatron-core and
Transformer Engine parts load only when used.
"""

from gnmr_dist.core import Decision, GNMRConfig, GNMRController, Schedule, Telemetry

__version__ = "0.1.0"

__all__ = [
    "Decision",
    "GNMRConfig",
    "GNMRController",
    "Schedule",
    "Telemetry",
    "__version__",
]
