"""The error term's cost now lives in :mod:`benchmarks.report.overhead` (with the run it reads);
this module keeps the old import path until its importers name that module."""

from benchmarks.report.overhead import FILE, error_cost

__all__ = ["FILE", "error_cost"]
