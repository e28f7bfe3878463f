"""The GPU check of ``te_fp8`` against Transformer Engine: an alias of ``gnmr-gpu-check``.

    python -m benchmarks.gpu.te_check [the arguments of gnmr-gpu-check]

The check ships in the package (:mod:`gnmr_dist.train.gpu_check`) as the console command
``gnmr-gpu-check``; this module runs the same program for the commands and documents that name
it. What each check compares, what fails it and the exit status: docs/backends.md#gnmr-gpu-check.
"""

from __future__ import annotations

import sys

from gnmr_dist.train.gpu_check.program import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
