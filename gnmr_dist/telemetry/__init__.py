"""Recording what the controller saw and decided: JSON-lines traces (rank 0 only)."""

from gnmr_dist.telemetry.trace import (
    TraceHeader,
    TraceReader,
    TraceWriter,
    read_accounting,
    read_errors,
    read_lrs,
    read_trace,
)

__all__ = [
    "TraceHeader",
    "TraceReader",
    "TraceWriter",
    "read_accounting",
    "read_errors",
    "read_lrs",
    "read_trace",
]
