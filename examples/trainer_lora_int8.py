"""Paper experiment 3 (docs/algorithm.md#lora-fine-tuning-with-int8) as a Hugging Face ``Trainer`` +
peft LoRA job with GNMR.

The frozen base runs W8A8 INT8 GEMMs (GNMR's ``int8`` backend); rank-16 LoRA adapters on the
seven projections are the only trained parameters; GNMR moves the riskiest projections to BF16
for the next step. The DeepSpeed config holds the
``"gnmr"`` block; the only GNMR line in the script is ``gnmr_dist.deepspeed.enable()``.
The config (``examples/trainer_lora_int8.json``, plain JSON as the Trainer reads it) leaves
``"auto"`` what the Trainer fills in from its own arguments (batch, accumulation, clipping, lr,
bf16).

CPU, tiny, from a local model (nothing is downloaded; ``--make-tiny DIR`` writes a 2-layer Llama
there first)::

    torchrun --nproc_per_node 2 examples/trainer_lora_int8.py --make-tiny runs/tiny_llama \\
        --model runs/tiny_llama --max-steps 8 --output-dir runs/trainer_lora

LLaMA-2 13B on 8 GPUs (the paper's run; a local Hugging Face directory and your text files)::

    torchrun --nproc_per_node 8 examples/trainer_lora_int8.py --model /models/Llama-2-13b-hf \\
        --tokenizer /models/Llama-2-13b-hf --data '/data/finetune/train/*.txt' --seq-len 1024 \\
        --batch 4 --max-steps 2000 --bf16 --output-dir runs/lora13b

Data: ``--data`` files (tokenized with ``--tokenizer``, or bytes without one) or, by default,
the project's embedded corpus (``gnmr_dist.data``), cut into fixed samples of ``--seq-len``.
Arms of the paper's table: INT8 (``"max_active": 0`` in the block), BF16 (``"enabled": false``),
GNMR INT8/BF16 (as shipped).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

import gnmr_dist.deepspeed
from gnmr_dist.data import make_dataset

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _CausalSamples(torch.utils.data.Dataset):
    """``{"input_ids", "labels"}`` rows of ``seq_len`` tokens (the model shifts the labels)."""

    def __init__(self, samples: torch.utils.data.Dataset) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.samples[i][:-1]
        return {"input_ids": row, "labels": row}


def make_tiny(path: str) -> None:
    """A 2-layer Llama with the byte vocabulary, saved as a local Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    layers = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    width = {"hidden_size": 64, "intermediate_size": 128}
    config = LlamaConfig(vocab_size=256, max_position_embeddings=256, **width, **layers)
    LlamaForCausalLM(config).save_pretrained(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a LOCAL Hugging Face model directory")
    p.add_argument("--make-tiny", metavar="DIR", help="first write a tiny Llama to DIR (CPU)")
    p.add_argument("--tokenizer", help="a local tokenizer directory (default: bytes)")
    p.add_argument("--data", default="embedded:train", help="text files/glob or embedded[:split]")
    p.add_argument("--deepspeed", default=str(ROOT / "examples" / "trainer_lora_int8.json"))
    p.add_argument("--output-dir", default="runs/trainer_lora_int8")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="per device")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--bf16", action="store_true", help="bf16 base weights (GPU)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO)
    args = parse_args(argv)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    if args.make_tiny and int(os.environ.get("RANK", "0")) == 0:
        make_tiny(args.make_tiny)
    if args.make_tiny:
        torch.distributed.init_process_group("gloo")  # to wait for rank 0's model directory
        torch.distributed.barrier()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=dtype)
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=TARGETS)
    model = get_peft_model(model, lora)
    data = _CausalSamples(
        make_dataset(args.data, args.seq_len + 1, args.tokenizer, max_bytes=2_000_000)
    )
    training = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=args.bf16,
        dataloader_drop_last=True,
    )
    gnmr_dist.deepspeed.enable()  # the one GNMR line: deepspeed.initialize reads the block
    Trainer(model=model, args=training, train_dataset=data).train()


if __name__ == "__main__":
    main()
