"""A user's own DeepSpeed script, as docs/deepspeed.md shows it: ``gnmr_dist.deepspeed.initialize``
in place of ``deepspeed.initialize``, a few steps, nothing done at exit (no barrier, no
``destroy_process_group``).

``torchrun --standalone --nproc-per-node 2 ds_user.py OUT_DIR [plain] [sync|async]``;
``plain``: DeepSpeed's own ``initialize`` and a config without the ``"gnmr"`` block; ``sync`` /
``async``: the run's metrics all-reduced as its last act, waited or left unwaited.
"""

import sys

import deepspeed
import deepspeed.ops
import torch
from tiny_llama import ds_config, llama

import gnmr_dist.deepspeed

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skips a 90 s CPU op build
plain = "plain" in sys.argv[2:]
model = llama()
config = ds_config(sys.argv[1], plain, micro_batch=2, lr=1e-3)
initialize = deepspeed.initialize if plain else gnmr_dist.deepspeed.initialize
engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
for step in range(6):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
decisions = 0 if plain else engine.gnmr.controller.step_count
print(f"rank {engine.global_rank}: {decisions} GNMR decisions, loss {loss.item():.4f}")
for tail in {"sync", "async"} & set(sys.argv[2:]):
    for metric in (loss.detach().clone(), torch.tensor([6.0])):
        torch.distributed.all_reduce(metric, async_op=tail == "async")
