"""A small HF Llama under real DeepSpeed (CPU, gloo), with per-rank deterministic data."""

from __future__ import annotations

import torch

VOCAB, SEQ, BATCH = 64, 16, 2
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def no_shm_build():
    """Skip DeepSpeed's CPU shared-memory op build (~90 s): only inference all-reduce uses it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg)


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def ds_config(stage: int, dtype: str = "fp32", gnmr: dict | None = None, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10_000,
        **extra,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if gnmr is not None:
        cfg["gnmr"] = gnmr
    return cfg


def unit_names(layers: int = 2) -> list[str]:
    attn = {"q_proj", "k_proj", "v_proj", "o_proj"}
    return [
        f"model.layers.{i}.{'self_attn' if p in attn else 'mlp'}.{p}"
        for i in range(layers)
        for p in PROJ
    ]


def gnmr_block(**overrides) -> dict:
    """The ``"gnmr"`` block the DeepSpeed tests share (act_quant, 2 recovered units, lock 2,
    warm-up 3, rank consistency checked), with ``overrides``."""
    base = {
        "backend": "act_quant",
        "max_active": 2,
        "lock_steps": 2,
        "warmup_steps": 3,
        "check_consistency": True,
    }
    return {**base, **overrides}
