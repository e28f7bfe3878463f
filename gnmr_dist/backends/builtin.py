"""The built-in backends, registered by importing this module (the one place that does).

``act_quant`` (:mod:`~gnmr_dist.backends.act_quant`), ``fp8_emulated``
(:mod:`~gnmr_dist.backends.emulated`), ``int8`` (:mod:`~gnmr_dist.backends.int8`),
``te_fp8`` (:mod:`~gnmr_dist.backends.te_fp8`) and ``torchao_fp8``
(:mod:`~gnmr_dist.backends.torchao_fp8`). :mod:`gnmr_dist.backends` imports it the first
time one of its names is used, so :data:`~gnmr_dist.backends.registry.BACKENDS` read through
the package always holds them; importing a backend's own module registers that backend alone.
"""

from __future__ import annotations

from gnmr_dist.backends import act_quant, emulated, int8, te_fp8, torchao_fp8

__all__ = ["act_quant", "emulated", "int8", "te_fp8", "torchao_fp8"]
