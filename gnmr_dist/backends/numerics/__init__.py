"""The number formats of the precision backends, emulated with torch ops (no backend here).

``formats`` (FP8 e4m3/e5m2, FP6 e3m2/e2m3, FP4 e2m1, the scale layouts), ``rounding`` (to nearest
and stochastic), ``scaled`` (fake quantization with tensor, row, block, NVFP4 and MXFP4 scales),
``hadamard`` (the random Hadamard transform of the FP4 weight gradient) and ``te_casts``
(Transformer Engine's own casts, bit for bit: its FP8 scales, MXFP8, NVFP4, its Hadamard
transform). Importing them
imports torch alone: no backend is registered (``docs/backends.md#number-formats``).
"""
