"""Bytes a small Llama keeps for backward, with projection inputs saved at 4, 8, 16 and 32 bits.

    python -m benchmarks.act_memory [--layers 4] [--hidden 256] [--tokens 2048]

Counts the unique storage of every tensor autograd saves during one forward
(``saved_tensors_hooks``; a tensor saved by q, k and v counts once), parameters excluded, for the
same model and batch: without a backend, and with the ``act_quant`` backend on
all seven projections of every layer at each width. Prints bytes and ratios to the 16-bit run,
for the projection inputs alone (what the backend controls) and for the whole model.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gnmr_dist.backends import get_backend
from gnmr_dist.distributed import UnitRegistry


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Unique bytes of the tensors autograd saves (a tensor saved by q, k and v counts once)."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(input_ids=tokens, labels=tokens).loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = LlamaForCausalLM(cfg)
    tokens = torch.randint(0, 512, (args.tokens // 256, 256))
    units = UnitRegistry.from_model(model).local_modules
    base = saved_bytes(model, tokens)
    rows = {}
    for bits in (32, 16, 8, 4):
        backend = get_backend("act_quant", low_cost={"bits": bits})
        backend.wrap(units)
        backend.apply((), step=1)
        rows[bits] = saved_bytes(model, tokens)
        backend.unwrap()
    # projection inputs alone: what the backend changed, from the 32-bit run (which saves every
    # distinct projection input once, in fp32, exactly as the model without a backend does)
    proj = {bits: projection_bytes(units, args.tokens, bits) for bits in rows}
    print(
        f"Llama {args.layers} layers x hidden {args.hidden}, {args.tokens} tokens, "
        f"{len(units)} projections"
    )
    print(f"no backend: {base / 2**20:.1f} MiB saved for backward by the whole model")
    print(f"{'bits':>5} {'projection MiB':>15} {'/ 16-bit':>9} {'model MiB':>10} {'/ 16-bit':>9}")
    for bits in (32, 16, 8, 4):
        print(
            f"{bits:>5} {proj[bits] / 2**20:>15.2f} {proj[bits] / proj[16]:>9.3f} "
            f"{rows[bits] / 2**20:>10.1f} {rows[bits] / rows[16]:>9.3f}"
        )
    print("projection: each projection alone on its own input (what the backend stores);")
    print("model: unique storage saved by the whole model (attention and MLP internals included,")
    print("and inputs that other ops also save stay alive whatever the projection keeps).")


def projection_bytes(units: dict, tokens: int, bits: int) -> int:
    """Unique bytes saved by every projection run alone on a fresh [tokens, in] input."""
    total = 0
    for uid, op in units.items():
        backend = get_backend("act_quant", low_cost={"bits": bits})
        backend.wrap({uid: op})
        backend.apply((), step=1)
        x = torch.randn(tokens, op.in_features, requires_grad=True)
        params = {op.weight.data_ptr()}
        seen: dict[int, int] = {}

        def keep(t: torch.Tensor, seen: dict = seen, params: set = params) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            op(x).sum().backward()
        backend.unwrap()
        total += sum(seen.values())
    return total


if __name__ == "__main__":
    main()
