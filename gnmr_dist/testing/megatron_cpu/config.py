"""A megatron ``TransformerConfig`` that builds and trains on CPU.

``cpu_transformer_config(**fields)`` builds a ``TransformerConfig`` for which
``GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), ...)`` builds and trains on
CPU in fp32, or in bf16 (``bf16=True``, ``params_dtype=torch.bfloat16``, wrapped in megatron's
``Float16Module``): CPU initialisation and every fused kernel off.
"""

from __future__ import annotations

from typing import Any

import torch

_CPU_REQUIRED: dict[str, Any] = {
    "use_cpu_initialization": True,
    "gradient_accumulation_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "memory_efficient_layer_norm": False,
    "cross_entropy_loss_fusion": False,
    "tp_comm_overlap": False,
}
"""Fields a CPU run cannot change: each selects a CUDA-only kernel or GPU initialisation."""

_CPU_DEFAULTS: dict[str, Any] = {
    "params_dtype": torch.float32,
    "pipeline_dtype": torch.float32,
}
"""Fields a caller may override (bf16 also needs megatron's ``Float16Module``)."""


def cpu_transformer_config(**fields: Any) -> Any:
    """A megatron ``TransformerConfig`` that builds and trains on CPU.

    ``fields`` are ``TransformerConfig`` fields (``num_layers``, ``hidden_size``,
    ``num_attention_heads`` are required by megatron). The CPU-required settings in
    ``_CPU_REQUIRED`` are filled in; passing one of them with another value raises
    ``ValueError``. ``params_dtype`` and ``pipeline_dtype`` default to fp32.

    Pass ``tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` equal to the sizes given
    to ``parallel_state.initialize_model_parallel``: megatron reads the number of layers per
    pipeline stage from the config, so a stale ``pipeline_model_parallel_size=1`` silently builds
    every layer on every stage.
    """
    from megatron.core.transformer import TransformerConfig

    for key, value in fields.items():
        if key in _CPU_REQUIRED and value != _CPU_REQUIRED[key]:
            raise ValueError(
                f"cpu_transformer_config: {key}={value!r} is not supported on CPU "
                f"(must be {_CPU_REQUIRED[key]!r})"
            )
    return TransformerConfig(**{**_CPU_DEFAULTS, **fields, **_CPU_REQUIRED})
