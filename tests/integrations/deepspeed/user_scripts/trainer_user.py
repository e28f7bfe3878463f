"""A user's own Trainer script, as docs/trainer.md shows it: a DeepSpeed config with a ``"gnmr"``
block, ``callbacks=[GNMRCallback()]``, a few steps, nothing done at exit (no barrier, no
``destroy_process_group``).

``torchrun --standalone --nproc-per-node 2 trainer_user.py OUT_DIR [plain]``; ``plain``: no
callback and a config without the ``"gnmr"`` block.
"""

import sys

import deepspeed.ops
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from gnmr_dist import GNMRCallback

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skips a 90 s CPU op build
out, plain = sys.argv[1], "plain" in sys.argv[2:]


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.rows = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


config = {
    "train_micro_batch_size_per_gpu": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
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
torch.manual_seed(0)
model = LlamaForCausalLM(
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
args = TrainingArguments(
    output_dir=f"{out}/trainer",
    deepspeed=config,
    per_device_train_batch_size=2,
    max_steps=6,
    learning_rate=1e-3,
    logging_steps=3,
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
)
callbacks = [] if plain else [GNMRCallback()]
trainer = Trainer(model=model, args=args, train_dataset=Rows(24), callbacks=callbacks)
result = trainer.train()
decisions = 0 if plain else trainer.model_wrapped.gnmr.controller.step_count
rank, loss = torch.distributed.get_rank(), result.training_loss
print(f"rank {rank}: {decisions} GNMR decisions, loss {loss:.4f}")
