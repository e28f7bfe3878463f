"""A user's own training loop with GNMR, as docs/distributed.md shows it: DDP over gloo, a
``UnitRegistry`` and a ``GNMRRuntime`` stepped before ``optimizer.step()``, then the run's
metrics all-reduced as its last act, and nothing done at exit (no barrier, no
``destroy_process_group``).

``torchrun --standalone --nproc-per-node 2 own_loop.py [TAIL] [plain]``. ``TAIL``: ``sync``
(default) all-reduces the metrics one by one; ``async`` starts their all-reduces and leaves
without waiting, as a script that forgot to. ``plain``: the same loop without GNMR.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

tail = sys.argv[1] if len(sys.argv) > 1 else "sync"
plain = "plain" in sys.argv[2:]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
ddp = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
if not plain:
    from gnmr_dist.core import GNMRConfig
    from gnmr_dist.distributed import GNMRRuntime, UnitRegistry

    registry = UnitRegistry.from_model(model, include=["*"], group=dist.group.WORLD)
    config = GNMRConfig(max_active=1, warmup_steps=2)
    runtime = GNMRRuntime(registry, config, group=dist.group.WORLD)
g = torch.Generator().manual_seed(dist.get_rank())
for _ in range(6):
    loss = ddp(torch.randn(16, 32, generator=g)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    if not plain:
        runtime.step(lr=optimizer.param_groups[0]["lr"])
    optimizer.step()
if dist.get_rank() == 0:
    print("decisions:", 0 if plain else runtime.controller.step_count, flush=True)
metrics = [loss.detach().clone(), torch.tensor([6.0]), torch.tensor([16.0 * 6])]
for metric in metrics:  # the run's last act: its metrics summed over the ranks
    dist.all_reduce(metric, async_op=tail == "async")
