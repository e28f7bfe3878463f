"""``gnmr-gpu-check``: ``te_fp8`` and the shadow route against Transformer Engine on one GPU.

* :mod:`~.program`: the command (arguments, the machine, printing, ``--json``, exit status);
* :mod:`~.runner`: checks, results, exit codes (no torch, no TE);
* :mod:`~.catalog`: every check, in running order;
* :mod:`~.host`: ``shadow_casts``, the shadow's casts on this torch (any machine);
* :mod:`~.operands`: the outlier operands and how casts are read back (pure torch);
* :mod:`~.te_quant`: ``quantizers``, ``shadow_bound`` (the shadow vs TE's quantizers);
* :mod:`~.te_model`: ``fp8_equal``, ``bf16_equal``, ``unit_bf16_equal``, ``stronger_recovery``,
  ``switching``, ``delayed_state``;
* :mod:`~.te_subsets`: ``gemm_subset``, ``nvfp4_refused``;
* :mod:`~.throughput`: ``tokens_per_s``;
* :mod:`~.mcore_checks`: ``megatron_operator``, ``megatron_fp4_refused``, ``megatron_gamma``.

Transformer Engine and megatron-core are imported inside the functions that use them only.
docs/backends.md#gnmr-gpu-check lists the checks.
"""
