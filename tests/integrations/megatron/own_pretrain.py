"""A pretrain script of its own on Megatron-LM's loop, with GNMR from the two documented lines.

Its providers are not ``gnmr-megatron-pretrain``'s: a GPT from megatron-core's local layer spec
with LayerNorm and a GELU MLP, a synthetic token data set (deterministic per index), and a
forward step that reads its batch on tensor-parallel rank 0 and broadcasts it. Run under
torchrun with Megatron-LM's flags plus ``--gnmr-config``
(``tests/integrations/megatron/test_megatron_lm.py``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from gnmr_dist.train.megatron_flags import attach_from_argv


class TokenSet(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``n`` samples of ``seq`` random tokens below ``vocab``, sample ``i`` from seed ``i``."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(int(i))
        text = torch.randint(0, self.vocab, (self.seq + 1,), generator=gen)
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.seq),
            "position_ids": torch.arange(self.seq),
        }


def model_provider(pre_process: bool = True, post_process: bool = True, **_: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    return GPTModel(
        config=core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
    )


def datasets_provider(num_samples: list[int]) -> tuple[Any, None, None]:
    from megatron.training import get_args

    args = get_args()
    return TokenSet(num_samples[0], args.seq_length, args.vocab_size), None, None


def _loss(mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    loss = (output.view(-1).float() * mask.view(-1)).sum()
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}


def _batch(data_iterator: Any) -> dict[str, torch.Tensor]:
    """Megatron builds the iterator on tensor-parallel rank 0 only: that rank reads the batch
    and broadcasts it over its tensor-parallel group (as ``get_batch_on_this_tp_rank`` does)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training import get_args

    args = get_args()
    shape = (args.micro_batch_size, args.seq_length)
    dtypes = {"tokens": torch.int64, "labels": torch.int64, "position_ids": torch.int64}
    dtypes["loss_mask"] = torch.float32
    data = next(data_iterator) if data_iterator is not None else None
    batch = {k: torch.empty(shape, dtype=d) if data is None else data[k] for k, d in dtypes.items()}
    group = parallel_state.get_tensor_model_parallel_group()
    source = parallel_state.get_tensor_model_parallel_src_rank()
    for value in batch.values():
        dist.broadcast(value, source, group=group)
    return batch


def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = _batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"].float())


def main(extra_args_provider: Any) -> None:
    """Megatron-LM's ``pretrain`` on these providers, GNMR's flags read by
    ``extra_args_provider`` (what ``attach_from_argv`` returned)."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    pretrain(
        datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        extra_args_provider=extra_args_provider,
    )


if __name__ == "__main__":
    main(attach_from_argv())  # reads --gnmr-* from sys.argv
