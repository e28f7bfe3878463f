"""A tiny megatron-core GPTModel on CPU, its full (TP1, PP1) twin, and the maps between them.

Every rank builds the full model with a fixed seed, then the parallel model of its layout, and
copies the full weights in: a ``tensor_model_parallel`` parameter takes its chunk along
``partition_dim``; a pipeline stage's (or virtual-pipeline chunk's) ``decoder.layers.<i>`` is
global layer ``layer_number - 1``, the number megatron's own offsets give it; a bf16 model gets
the fp32 weights rounded to bf16. So the parallel run and the single-process run hold the same
model, and their gradients can be compared slice for slice. Requires megatron-core and
``gnmr_dist.testing.megatron_cpu``. ``tests/integrations/megatron/settings.py`` builds the full
set of layouts (bf16, distributed optimizer, sequence parallel, virtual pipeline) on top of this
module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256}
VOCAB, SEQ, MICRO_BATCH, NUM_MICRO, SEED = 128, 16, 2, 2, 1234


def gpt_config(tp: int, pp: int, **fields):
    """The tiny model's ``TransformerConfig`` for a TP x PP layout (``fields`` override/extend)."""
    from gnmr_dist.testing.megatron_cpu import cpu_transformer_config

    return cpu_transformer_config(
        **MODEL,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_func=torch.nn.functional.gelu,
        **fields,
    )


def build_gpt(tp: int, pp: int, *, config=None, vp_stage: int | None = None):
    """The GPTModel of this rank's stage (gelu MLP: its fc1 splits contiguously over TP).

    ``config``: a ready ``gpt_config(...)`` (default: ``gpt_config(tp, pp)``). ``vp_stage``: the
    virtual pipeline chunk to build (None without virtual pipelining); the chunk's layers then
    carry their global ``layer_number`` from megatron's own offsets.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = gpt_config(tp, pp) if config is None else config
    stage = {} if vp_stage is None else {"vp_stage": vp_stage}
    first = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    return GPTModel(
        config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
        **stage,
    )


def micro_batch(dp_rank: int, index: int, step: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + 100 * dp_rank + index + 10_000 * step)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": position_ids}


def loss_func(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), loss_func


def full_reference(dp_size: int):
    """The full model (seed SEED) after backward on every DP rank's micro-batches averaged."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    full = build_gpt(1, 1)
    batches = [micro_batch(d, m) for d in range(dp_size) for m in range(NUM_MICRO)]
    outputs = [full(b["tokens"], b["position_ids"], None, labels=b["labels"]) for b in batches]
    loss = sum(loss_func(o)[0] for o in outputs) / len(batches)
    loss.backward()
    ps.destroy_model_parallel()
    return full, float(loss)


def tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    assert getattr(param, "partition_stride", 1) == 1
    return torch.chunk(full, tp, dim=param.partition_dim)[tp_rank]


def copy_full_weights(model, full, tp_rank: int, tp: int) -> None:
    """Copy the full model's weights into ``model`` (a stage or chunk; cast to its dtype)."""
    from gnmr_dist.distributed.units import global_param_names
    from gnmr_dist.integrations.megatron.operators import MEGATRON_MARKS

    source, names = dict(full.named_parameters()), global_param_names(model, marks=MEGATRON_MARKS)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tp_slice(source[names[name]].detach(), param, tp_rank, tp))


def parallel_model(tp: int, pp: int, full):
    """This rank's stage of the full model, wrapped in megatron's DistributedDataParallel."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    model = build_gpt(tp, pp)
    copy_full_weights(model, full, ps.get_tensor_model_parallel_rank(), tp)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def train_step(model, step: int = 0) -> float | None:
    """One forward/backward over NUM_MICRO micro-batches with megatron's schedule.

    Starts like Megatron-LM's ``train_step``: the grad buffer zeroed and every parameter's
    ``.grad`` cleared (what ``optimizer.zero_grad()`` does). After ``optimizer.step()`` a fp32
    parameter's ``.grad`` *is* its ``main_grad``; left in place, the next backward accumulates
    into the buffer through ``.grad`` and again through DDP's hook (first micro-batch counted
    twice).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    for param in model.parameters():
        param.grad = None
    dp_rank = ps.get_data_parallel_rank()
    data = iter([micro_batch(dp_rank, m, step) for m in range(NUM_MICRO)])
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[model],
        num_microbatches=NUM_MICRO,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    if not ps.is_pipeline_last_stage():
        return None
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss) / ps.get_data_parallel_world_size()


def megatron_grad_norm(model) -> float:
    """megatron-core's own de-duplicated grad norm (the one gradient clipping uses)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer.module import param_is_not_shared

    grads = [
        p.main_grad
        for p in model.parameters()
        if param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)
    ]
    return float(
        clip_grads.get_grad_norm_fp32(
            grads, grad_stats_parallel_group=ps.get_model_parallel_group()
        )
    )
