"""What several benchmarks share: the results folder, the command line and its logging, a Llama,
interleaved timing, a gloo world, strict JSON and the plots' figure, error bars and last lines.

Nothing here measures; the measuring lives with each benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gnmr_dist.distributed.comm import join_local_world, local_store

RESULTS = Path(__file__).resolve().parents[1] / "results"
"""Where the benchmarks write their JSON and plots (``benchmarks/results``)."""


def arg_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command's parser, described by the first paragraph of its module docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])


def start_cli(threads: int | None = None) -> None:
    """A command's set-up: its own INFO messages (progress, tables, verdicts: the loggers of
    ``benchmarks`` and of the command's ``__main__``) bare on stdout, the library's warnings
    only; given ``threads``, torch's intra-op threads."""
    # the root at WARNING keeps the library's INFO lines (backends wrapping units) out of a
    # command's printed tables
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    for name in ("benchmarks", "__main__"):
        logging.getLogger(name).setLevel(logging.INFO)
    if threads is not None:
        torch.set_num_threads(threads)


def llama(
    *, vocab: int, hidden: int, ffn: int, layers: int, heads: int, seed: int, **config: Any
) -> nn.Module:
    """A Hugging Face ``LlamaForCausalLM`` (as many key/value heads as heads) whose initial
    weights are drawn after ``torch.manual_seed(seed)``; ``config``: further ``LlamaConfig``
    keys (``max_position_embeddings``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # Hugging Face draws the initial weights from the global stream: seeded here, every arm of a
    # seed starts from the same weights
    torch.manual_seed(seed)
    sizes = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn}
    heads_kv = {"num_attention_heads": heads, "num_key_value_heads": heads}  # no grouped queries
    cfg = LlamaConfig(**sizes, num_hidden_layers=layers, **heads_kv, **config)
    return LlamaForCausalLM(cfg)


def hf_loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own next-token loss, ``model(input_ids=tokens, labels=tokens).loss``
    (Hugging Face shifts the labels itself; DeepSpeed engines pass the call through)."""
    return model(input_ids=tokens, labels=tokens).loss  # type: ignore[no-any-return]


@contextlib.contextmanager
def gloo_world(rank: int = 0, world: int = 1, port: int | None = None) -> Iterator[None]:
    """This process as rank ``rank`` of a gloo ``torch.distributed`` world on this machine,
    with the environment a launcher sets (DeepSpeed and megatron read it); torn down, and the
    environment restored, on exit. ``port``: the store the world meets at, served by the
    process that started it (``local_store``); default: a world of one serves its own."""
    # joining sets the launcher's variables (MASTER_ADDR, RANK, ...); restored on exit, so a later
    # world in this process reads none of them stale
    saved = dict(os.environ)
    store = local_store() if port is None else None  # kept alive while the world lives
    join_local_world(port if store is None else store.port, rank, world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def interleaved_times(
    arms: dict[str, Callable[[], object]],
    repeats: int,
    warm: int = 3,
    clock: Callable[[], float] = time.process_time,
) -> dict[str, list[float]]:
    """``clock`` seconds of each arm over ``repeats`` rounds after ``warm`` untimed ones (caches,
    allocator), the order of the arms rotating every round (so a slow stretch of the machine hits
    every arm). The default clock is this process's CPU time."""
    times: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for r in range(warm + repeats):
        # the order rotates: an arm always timed first would alone pay each round's cold start
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = clock()
            arms[name]()
            if r >= warm:
                times[name].append(clock() - t0)
    return times


def skip_deepspeed_shm_comm() -> None:
    """Keep DeepSpeed from building its shm comm op (inference-only; building it takes ~90 s)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@contextlib.contextmanager
def deepspeed_world() -> Iterator[None]:
    """A world of one process over gloo for DeepSpeed (it needs ``torch.distributed``)."""
    with gloo_world():
        skip_deepspeed_shm_comm()
        yield


def jsonable(x: Any) -> Any:
    """``x`` with tuples as lists, keys as strings and NaN as ``None`` (strict JSON)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return [jsonable(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def subplots(*args: Any, **kwargs: Any) -> Any:
    """``plt.subplots(*args, **kwargs)`` on matplotlib's file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def errorbar(ax: Any, xs: list[float], pairs: list[Any], **kwargs: Any) -> None:
    """Means with their 95% half-widths (``(mean, half)`` pairs) as error bars at ``xs``; a NaN
    half-width (one seed) draws none."""
    hs = [0.0 if math.isnan(h) else h for _, h in pairs]
    ax.errorbar(xs, [m for m, _ in pairs], yerr=hs, capsize=3, **kwargs)


def finish_plot(fig: Any, path: Path, legend_size: int = 8) -> None:
    """Grid and legend on every axes of ``fig``, then ``fig`` written to ``path`` (110 dpi) and
    closed."""
    import matplotlib.pyplot as plt

    for ax in fig.axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
