"""Distributed monitoring: units with global ids, per-shard norms, one small all-reduce.

Imports ``gnmr_dist.core`` and torch only; process groups are always passed in explicitly.
"""

from gnmr_dist.distributed.accounting import AccountingSummary, NonFinite
from gnmr_dist.distributed.comm import all_gather_objects, all_reduce_sum
from gnmr_dist.distributed.monitor import GradNormMonitor, UnitNorms, sum_of_squares_by_slot
from gnmr_dist.distributed.runtime import (
    GNMRRuntime,
    Plan,
    build_controller,
    check_same_decision,
)
from gnmr_dist.distributed.units import UnitRegistry, is_operator, operator_shapes

__all__ = [
    "AccountingSummary",
    "GNMRRuntime",
    "GradNormMonitor",
    "NonFinite",
    "Plan",
    "UnitNorms",
    "UnitRegistry",
    "all_gather_objects",
    "all_reduce_sum",
    "build_controller",
    "check_same_decision",
    "is_operator",
    "operator_shapes",
    "sum_of_squares_by_slot",
]
