"""What both user scripts train: a tiny Llama and its DeepSpeed config.

The scripts import it as their own sibling module: torchrun starts each with
``python script.py``, which puts the script's folder first on ``sys.path``.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def llama() -> LlamaForCausalLM:
    """A 2-layer Llama of width 32 over 64 tokens, its weights drawn after ``manual_seed(0)``."""
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
    )


def ds_config(out: str, plain: bool, micro_batch: int | str, lr: float | str) -> dict:
    """ZeRO-2 with torch's AdamW and, unless ``plain``, a ``"gnmr"`` block (act_quant, 2
    recovered units, warm-up 2) tracing to ``out/trace.jsonl``; ``"auto"`` batch and lr for
    Trainer to fill in."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10_000,
        "gnmr": {
            "backend": "act_quant",
            "max_active": 2,
            "warmup_steps": 2,
            "log": {"trace": f"{out}/trace.jsonl"},
        },
    }
    if plain:
        del config["gnmr"]
    return config
