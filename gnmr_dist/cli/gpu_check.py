"""``gnmr-gpu-check``: the GPU check of ``te_fp8`` against Transformer Engine,
:mod:`gnmr_dist.train.gpu_check`."""

from gnmr_dist.train.gpu_check.program import main

if __name__ == "__main__":
    raise SystemExit(main())
