"""Checks that need an NVIDIA GPU: :mod:`.te_check`, the ``te_fp8`` backend against plain
Transformer Engine."""
