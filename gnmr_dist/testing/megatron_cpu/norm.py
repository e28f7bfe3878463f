"""megatron-core's torch norm under sequence parallelism (the local layer spec's only norm).

What is patched, and why:

* ``transformer.torch_norm.WrappedTorchNorm.__new__`` -> the original, plus sequence
  parallelism: it builds the same ``torch.nn.LayerNorm``/``RMSNorm`` and marks its parameters
  ``sequence_parallel=config.sequence_parallel``, as apex's ``FusedLayerNorm`` and TE's norms
  do. The original asserts ``not config.sequence_parallel`` because unmarked norm weights would
  keep the partial gradients of their TP rank's sequence slice; marked, ``finalize_model_grads``
  all-reduces them over TP (``_allreduce_non_tensor_model_parallel_grads``). It is the only norm
  of the local layer spec without TE or apex (also the final norm and ``qk_layernorm``).
"""

from __future__ import annotations

import copy
import functools
from typing import Any


def _cpu_torch_norm_new(original: Any) -> Any:
    """``WrappedTorchNorm.__new__`` that supports sequence parallelism, as ``FusedLayerNorm`` does.

    The original asserts ``not config.sequence_parallel`` because a plain torch norm does not
    mark its weights; under sequence parallelism each TP rank sees a slice of the sequence, so
    the norm's weight gradients are partial sums that ``finalize_model_grads`` must all-reduce
    over TP, which it does for parameters marked ``sequence_parallel=True``. This builds the same
    torch norm and marks its parameters with ``config.sequence_parallel`` (like apex's
    ``FusedLayerNorm`` and TE's norms in megatron).
    """

    def __new__(cls: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        sequence_parallel = bool(config.sequence_parallel)
        if sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False  # its only objection; the marks below answer it
        norm = original(cls, config, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    return staticmethod(functools.wraps(original)(__new__))
