"""Command-line entry points (console scripts in setup.py; each also runs as ``python -m``).

Thin: argument parsing and printing only; the programs are :mod:`gnmr_dist.train`, the trace
tools :mod:`gnmr_dist.telemetry`.
"""
