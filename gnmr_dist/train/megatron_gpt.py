"""Megatron-LM's ``pretrain_gpt.py`` providers, as :func:`megatron.training.pretrain` takes them:
the GPT model, the forward step with its loss, and the blended GPT data sets (megatron-core's own
classes, from Megatron-LM's parsed arguments). :mod:`gnmr_dist.train.megatron_lm` hands them to
``pretrain`` unchanged; GNMR attaches through
:func:`gnmr_dist.train.megatron_flags.attach_from_argv`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import torch

__all__ = ["datasets_provider", "forward_step", "model_provider"]


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: Any = None,
    pg_collection: Any = None,
) -> Any:
    """``pretrain_gpt.py``'s GPT model from Megatron-LM's arguments (megatron-core modules)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = core_transformer_config_from_args(args)
    spec = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=args.transformer_impl == "transformer_engine",
        normalization=args.normalization,
        vp_stage=vp_stage,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
    )


def _loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of token losses, token count, and the report megatron averages over DP."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
    """``pretrain_gpt.py``'s forward step: the TP-broadcast, CP-sliced batch through the model."""
    from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank
    from megatron.training.utils import get_batch_on_this_tp_rank, is_first_or_last_pipeline_stage

    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens = labels = loss_mask = attention_mask = position_ids = None
    if is_first_or_last_pipeline_stage(vp_stage):
        batch = get_batch_on_this_cp_rank(get_batch_on_this_tp_rank(data_iterator))
        tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
        attention_mask, position_ids = batch["attention_mask"], batch["position_ids"]
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(_loss_func, cast(torch.Tensor, loss_mask))


def datasets_provider(num_samples: Sequence[int], vp_stage: int | None = None) -> Any:
    """``pretrain_gpt.py``'s GPT data sets: megatron-core's blended builder over ``--data-path``."""
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import (
        get_blend_and_blend_per_split,
        is_first_or_last_pipeline_stage,
    )

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )

    def built_here() -> bool:
        first_or_last = is_first_or_last_pipeline_stage(vp_stage)
        return bool(first_or_last and parallel_state.get_tensor_model_parallel_rank() == 0)

    kind = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(kind, num_samples, built_here, config).build()


datasets_provider.is_distributed = True  # type: ignore[attr-defined]  # as pretrain_gpt.py
