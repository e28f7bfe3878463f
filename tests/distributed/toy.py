"""A small layered model and its hand-made tensor/pipeline-parallel shards, for monitor tests.

``shard`` builds what one rank of a TP x PP layout holds: column-parallel ``fc1`` and ``head``
(rows split), row-parallel ``fc2`` (columns split, bias replicated), vocab-parallel ``embed``, and
replicated norms, with megatron's ``tensor_model_parallel`` mark on the split ones. Its gradients
are the matching slices of the full model's gradients, which is what real TP produces (the
megatron-core tests check that with real TP forward/backward passes).
"""

from __future__ import annotations

import torch
from torch import nn

from gnmr_dist.distributed.units import ModelMarks

HIDDEN, FFN, VOCAB, LAYERS = 8, 16, 32, 4

MARKS = ModelMarks(sharded=("tensor_model_parallel",))
"""The mark :func:`shard` sets, as the integration of a TP framework names it to the registry."""


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN, ffn: int = FFN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Toy(nn.Module):
    def __init__(
        self,
        layers: int = LAYERS,
        hidden: int = HIDDEN,
        ffn: int = FFN,
        vocab: int = VOCAB,
        embed: bool = True,
        head: bool = True,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden) if embed else None
        self.layers = nn.ModuleList(Block(hidden, ffn) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False) if head else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def full_model_with_grads(seed: int = 0, spike: dict[str, float] | None = None) -> Toy:
    """A Toy model after one backward pass on a fixed batch (``spike`` scales named grads)."""
    torch.manual_seed(seed)
    model = Toy()
    tokens = torch.randint(0, VOCAB, (4, 6))
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, 1).flatten())
    loss.backward()
    for name, factor in (spike or {}).items():
        model.get_parameter(name).grad.mul_(factor)
    return model


SPLIT_DIM = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "embed.weight": 0, "head.weight": 0}


def _split_dim(name: str) -> int | None:
    for suffix, dim in SPLIT_DIM.items():
        if name.endswith(suffix):
            return dim
    return None


def shard(full: Toy, tp: int, tp_rank: int, pp: int, pp_rank: int) -> Toy:
    """What rank (tp_rank, pp_rank) holds of ``full``: parameters and gradients."""
    per_stage = LAYERS // pp
    lo = pp_rank * per_stage
    model = Toy(
        layers=per_stage,
        ffn=FFN // tp,
        vocab=VOCAB // tp,
        embed=pp_rank == 0,
        head=pp_rank == pp - 1,
    )
    for name, param in model.named_parameters():
        full_name = name
        if name.startswith("layers."):
            idx, rest = name.split(".", 2)[1:]
            full_name = f"layers.{int(idx) + lo}.{rest}"
        source = full.get_parameter(full_name)
        dim = _split_dim(name)
        data, grad = source.data, source.grad
        if dim is not None:
            data, grad = data.chunk(tp, dim)[tp_rank], grad.chunk(tp, dim)[tp_rank]
            param.tensor_model_parallel = True
        param.data.copy_(data)
        param.grad = grad.clone()
    return model


def reference_unit_norms(model: nn.Module, units: list[str]) -> tuple[list[float], float]:
    """Per-unit norms straight from ``named_parameters`` of the full model, and the global norm."""
    sq = dict.fromkeys(units, 0.0)
    for name, param in model.named_parameters():
        owner = [u for u in units if name.startswith(u + ".")]
        if owner:
            sq[owner[0]] += float(param.grad.double().pow(2).sum())
    total = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
    return [sq[u] ** 0.5 for u in units], total**0.5
