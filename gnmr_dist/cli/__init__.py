"""Command-line entry points (installed as console scripts by setup.py)."""
