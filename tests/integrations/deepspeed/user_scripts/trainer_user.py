"""A user's own Trainer script, as docs/trainer.md shows it: a DeepSpeed config with a ``"gnmr"``
block, ``callbacks=[GNMRCallback()]``, a few steps, nothing done at exit (no barrier, no
``destroy_process_group``).

``torchrun --standalone --nproc-per-node 2 trainer_user.py OUT_DIR [plain]``; ``plain``: no
callback and a config without the ``"gnmr"`` block.
"""

import sys

import deepspeed.ops
import torch
from tiny_llama import ds_config, llama
from transformers import Trainer, TrainingArguments

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


config = ds_config(out, plain, micro_batch="auto", lr="auto")
model = llama()
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
