"""Checks that need an NVIDIA GPU: :mod:`.te_check`, the ``te_fp8`` backend against plain
Transformer Engine (an alias of ``gnmr-gpu-check``, which ships in the package:
:mod:`gnmr_dist.train.gpu_check`)."""
