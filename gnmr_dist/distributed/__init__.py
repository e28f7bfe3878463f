"""Distributed monitoring: units with global ids, per-shard norms, one small all-reduce.

Imports ``gnmr_dist.core`` and torch only; process groups are always passed in explicitly.
"""

from gnmr_dist.distributed.comm import all_gather_objects, all_reduce_sum
from gnmr_dist.distributed.monitor import GradNormMonitor, UnitNorms, sum_of_squares_by_slot
from gnmr_dist.distributed.runtime import GNMRRuntime, Plan, check_same_decision
from gnmr_dist.distributed.units import UnitRegistry, is_operator

__all__ = [
    "GNMRRuntime",
    "GradNormMonitor",
    "Plan",
    "UnitNorms",
    "UnitRegistry",
    "all_gather_objects",
    "all_reduce_sum",
    "check_same_decision",
    "is_operator",
    "sum_of_squares_by_slot",
]
