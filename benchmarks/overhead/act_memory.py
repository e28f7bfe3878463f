"""Bytes a small Llama keeps for backward, with projection inputs saved at 4, 8, 16 and 32 bits.

    python -m benchmarks.overhead.act_memory [--layers 4] [--hidden 256] [--tokens 2048]

The unique storage autograd saves during one forward, without a backend and with ``act_quant``
at each width, for the projection inputs alone and the whole model:
docs/benchmarks.md#overhead-act_memory.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from benchmarks.harness.common import arg_parser, hf_loss, llama, start_cli
from gnmr_dist.backends import get_backend
from gnmr_dist.distributed import UnitRegistry

logger = logging.getLogger(__name__)

BITS = (32, 16, 8, 4)


def saved_bytes(loss: Callable[[], torch.Tensor], params: Iterable[torch.Tensor]) -> int:
    """Unique bytes of the storages autograd saves for backward while ``loss()`` runs (one
    storage saved by several ops, as q, k and v save their input, counts once), the storages of
    ``params`` excluded (they exist anyway); then backpropagates ``loss()``'s result."""
    skip = {p.data_ptr() for p in params}
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss().backward()
    return sum(seen.values())


def model_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """:func:`saved_bytes` of the whole model's loss on ``tokens`` (gradients dropped after)."""
    total = saved_bytes(lambda: hf_loss(model, tokens), model.parameters())
    model.zero_grad(set_to_none=True)
    return total


def projection_bytes(units: dict, tokens: int, bits: int) -> int:
    """Unique bytes saved by every projection run alone on a fresh [tokens, in] input."""
    total = 0
    for uid, op in units.items():
        backend = get_backend("act_quant", low_cost={"bits": bits})
        backend.wrap({uid: op})
        backend.apply((), step=1)
        x = torch.randn(tokens, op.in_features, requires_grad=True)
        total += saved_bytes(lambda op=op, x=x: op(x).sum(), [op.weight])
        backend.unwrap()
    return total


def parse_args() -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    start_cli()
    model = llama(
        vocab=512, hidden=args.hidden, ffn=args.hidden * 3, layers=args.layers, heads=4, seed=0
    )
    tokens = torch.randint(0, 512, (args.tokens // 256, 256))
    units = UnitRegistry.from_model(model).local_modules
    base = model_bytes(model, tokens)
    rows = {}
    for bits in BITS:
        backend = get_backend("act_quant", low_cost={"bits": bits})
        backend.wrap(units)
        backend.apply((), step=1)
        rows[bits] = model_bytes(model, tokens)
        backend.unwrap()
    # projection inputs alone: what the backend changed, from the 32-bit run (which saves every
    # distinct projection input once, in fp32, exactly as the model without a backend does)
    proj = {bits: projection_bytes(units, args.tokens, bits) for bits in rows}
    lines = [
        f"Llama {args.layers} layers x hidden {args.hidden}, {args.tokens} tokens, "
        f"{len(units)} projections",
        f"no backend: {base / 2**20:.1f} MiB saved for backward by the whole model",
        f"{'bits':>5} {'projection MiB':>15} {'/ 16-bit':>9} {'model MiB':>10} {'/ 16-bit':>9}",
    ]
    lines += [
        f"{bits:>5} {proj[bits] / 2**20:>15.2f} {proj[bits] / proj[16]:>9.3f} "
        f"{rows[bits] / 2**20:>10.1f} {rows[bits] / rows[16]:>9.3f}"
        for bits in BITS
    ]
    logger.info(
        "\n".join(lines)
        + "\nprojection: each projection alone on its own input (what the backend stores);"
        "\nmodel: unique storage saved by the whole model (attention and MLP internals included,"
        "\nand inputs that other ops also save stay alive whatever the projection keeps)."
    )


if __name__ == "__main__":
    main()
