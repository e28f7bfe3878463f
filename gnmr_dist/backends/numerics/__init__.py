"""The number formats of the precision backends, emulated with torch ops (no backend here).

``formats`` (FP8 e4m3/e5m2, FP6 e3m2/e2m3, FP4 e2m1, the scale layouts), ``rounding`` (to nearest
and stochastic), ``scaled`` (fake quantization with tensor, row, block, NVFP4 and MXFP4 scales)
and ``hadamard`` (the random Hadamard transform of the FP4 weight gradient). Importing them
imports torch alone: no backend is registered (``docs/backends.md#number-formats``).
"""
