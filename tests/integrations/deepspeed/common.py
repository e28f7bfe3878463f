"""A small HF Llama under real DeepSpeed (CPU, gloo), with per-rank deterministic data."""

from __future__ import annotations

from typing import Any

import torch

VOCAB, SEQ, BATCH = 64, 16, 2
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def no_shm_build():
    """Skip DeepSpeed's CPU shared-memory op build (~90 s): only inference all-reduce uses it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def llama(
    seed: int = 0, layers: int = 2, vocab: int = VOCAB, hidden: int = 32, positions: int = SEQ
):
    """A ``LlamaForCausalLM`` of ``layers`` layers of width ``hidden`` (MLP twice as wide, 4
    heads over 2 key/value heads), its weights drawn after ``torch.manual_seed(seed)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
    )
    return LlamaForCausalLM(cfg)


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


class Rows:
    """``n`` micro-batches of :func:`batch` rows (rank 0's) as a map-style data set, each row its
    own labels: what ``Trainer`` reads, ``BATCH`` rows a step per rank."""

    def __init__(self, n: int) -> None:
        self.rows = [row for i in range(n) for row in batch(i, 0)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def trainer_args(output_dir: str, config: dict[str, Any], steps: int, **extra: Any) -> Any:
    """``TrainingArguments`` of a ``steps``-step Trainer run on the DeepSpeed ``config``, whose
    micro-batch size and learning rate become ``"auto"`` (Trainer fills in ``BATCH`` and 1e-3
    unless ``extra``, more ``TrainingArguments``, names another); no checkpoint unless asked."""
    from transformers import TrainingArguments

    config["optimizer"]["params"]["lr"] = config["train_micro_batch_size_per_gpu"] = "auto"
    return TrainingArguments(
        output_dir=output_dir,
        deepspeed=config,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        report_to=[],
        disable_tqdm=True,
        dataloader_drop_last=True,
        **{"learning_rate": 1e-3, "save_strategy": "no", **extra},
    )


def gnmr_logs(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``gnmr/*`` keys of Trainer's loss entries (``log_history``), ``gnmr/recovered_at``
    left out, each with the entry's ``step``."""
    return [
        {k: v for k, v in e.items() if k.startswith("gnmr/") and k != "gnmr/recovered_at"}
        | {"step": e["step"]}
        for e in history
        if "loss" in e
    ]


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
