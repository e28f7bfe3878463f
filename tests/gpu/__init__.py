"""Tests that need an NVIDIA GPU (and TE where named): ``pytest -m gpu tests/gpu``."""
