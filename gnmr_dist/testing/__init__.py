"""Test apparatus that ships with gnmr-dist but is not part of the product.

* :mod:`gnmr_dist.testing.megatron_cpu`: CPU stand-ins for megatron-core's hard-wired CUDA calls
  (``enable_cpu_compat`` / ``disable_cpu_compat``, ``cpu_compat``, ``cpu_transformer_config``),
  for tests and for users running megatron-core on a CPU host;
* :mod:`gnmr_dist.testing.drills`: the deterministic disturbances the programs' drill flags load
  (``--fail-at``, ``--gnmr-fail-at``, ``--gnmr-inject-grad-spike``);
* :mod:`gnmr_dist.testing.scores`: the torch reference of the scores, which the tests hold the
  numpy policy to, bit for bit.

Nothing here is among the product's public names, and no module of the product imports this
package: only the programs (``gnmr_dist.train``) do, lazily, when a drill flag or a CPU run asks
for it (``tests/test_layout.py``). The submodules load on import, one by one; this file imports
none of them (``megatron_cpu`` needs megatron-core only when switched on).
"""
