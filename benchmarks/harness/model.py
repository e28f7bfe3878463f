"""The harness's model and data: a small Llama on byte tokens, deterministic batches, held-out
evaluation, injected faults and saved weights."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.harness.arms import Fault, Setup
from benchmarks.harness.common import llama
from gnmr_dist.backends import PrecisionBackend
from gnmr_dist.train.common import next_token_loss

VOCAB = 258
"""The byte vocabulary of the harness's Llama (``gnmr_dist.data``'s tokens)."""


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven projections of a Llama layer (the LoRA targets)."""


def build_model(setup: Setup) -> nn.Module:
    """The Llama of ``setup`` from its seed (or ``setup.init_from``'s weights), with LoRA
    adapters of rank ``setup.lora_rank`` on every projection when that is > 0."""
    model = llama(
        vocab=VOCAB,
        hidden=setup.hidden,
        ffn=setup.ffn,
        layers=setup.layers,
        heads=setup.heads,
        seed=setup.seed,
        max_position_embeddings=setup.seq_len,
    )
    if setup.init_from is not None:
        model.load_state_dict(torch.load(setup.init_from, weights_only=True))
    if setup.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        rank = setup.lora_rank
        targets = list(PROJECTIONS)
        # no dropout: the arms must differ in precision only, and dropout would draw per step
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets)
        model = get_peft_model(model, lora)
    return model


class Batches:
    """Deterministic batches: batch ``i`` is samples ``i * batch ...`` of a fixed permutation."""

    def __init__(self, spec: str, setup: Setup) -> None:
        from gnmr_dist.data import make_dataset

        self.data = make_dataset(spec, setup.seq_len, max_bytes=setup.max_bytes)
        # its own generator: the order depends on the seed alone, not on what building a model or a
        # probe took from the global stream, so every arm of a seed sees the same batches
        gen = torch.Generator().manual_seed(setup.seed)
        self.order = torch.randperm(len(self.data), generator=gen)
        self.batch = setup.batch

    def __call__(self, i: int) -> torch.Tensor:
        idx = [int(self.order[(i * self.batch + j) % len(self.order)]) for j in range(self.batch)]
        return torch.stack([self.data[k] for k in idx])


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (the same as ``gnmr-ds-pretrain``'s)."""
    return next_token_loss(model, tokens)


def evaluate(
    model: nn.Module, heldout: Batches, batches: int, backend: PrecisionBackend | None = None
) -> float:
    """Mean held-out loss; inside the backend's ``measuring()`` (evaluation leaves training
    state such as delayed-scaling amax histories alone)."""
    # eval mode: the fault hooks and the outlier forwards act only while model.training
    model.eval()
    measuring = backend.measuring() if backend is not None else contextlib.nullcontext()
    with torch.no_grad(), measuring:
        losses = [float(lm_loss(model, heldout(i))) for i in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def install_faults(model: nn.Module, faults: Sequence[Fault], step: Callable[[], int]) -> None:
    """Forward pre-hooks applying ``faults`` while ``model.training`` and the step is in window."""
    modules = dict(model.named_modules())
    for fault in faults:
        if fault.module not in modules:
            near = [n for n in modules if n.endswith(fault.module.split(".")[-1])][:4]
            raise ValueError(f"fault module {fault.module!r} is not in the model; e.g. {near}")
        modules[fault.module].register_forward_pre_hook(_fault_hook(fault, step, model))


def _fault_hook(fault: Fault, step: Callable[[], int], model: nn.Module) -> Callable[..., Any]:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        t = step()
        # evaluations run without the fault: the held-out loss measures what training did
        if not (model.training and fault.start <= t < fault.stop):
            return None
        x = args[0]
        if fault.channel is None:
            return (x * fault.factor(t), *args[1:])
        factor = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        factor[fault.channel] = fault.factor(t)
        return (x * factor, *args[1:])

    return hook


def save_state(model: nn.Module, path: str | Path) -> None:
    """Write ``model.state_dict()`` to ``path`` (loadable by ``Setup.init_from``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
