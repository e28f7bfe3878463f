"""GPT pretraining on Megatron-LM's own training loop, with GNMR: ``gnmr-megatron-pretrain``.

    torchrun --nproc_per_node 8 -m gnmr_dist.cli.megatron_pretrain \\
        <any argument set of Megatron-LM's pretrain_gpt.py> --gnmr-config gnmr.json

The program is ``pretrain_gpt.py`` (its providers: :mod:`gnmr_dist.train.megatron_gpt`) with
GNMR attached the way any pretrain script gets it,
:func:`gnmr_dist.train.megatron_flags.attach_from_argv`: Megatron-LM's argument parser, data sets
(``--data-path``, blends, splits, ``--mock-data``), LR schedules, distributed optimizer,
TP/SP/PP/VPP/CP, checkpointing and TensorBoard / W&B writers run unchanged, on megatron-core
0.17+ (the version table's ``has_training``). The program adds a preflight of what megatron
will import (``require_training``: each missing package named with its pip command) and of its
own data flags (:func:`check_data_split`) and, for ``gnmr-launch check``, :func:`check_args`:
megatron's own parser and validation of a whole argument set in one process.
"""

from __future__ import annotations

import argparse
import logging
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gnmr_dist.integrations.megatron.loop import require_training
from gnmr_dist.train import megatron_flags, megatron_gpt
from gnmr_dist.train.common import setup_logging

__all__ = ["check_args", "check_data_split", "main"]

logger = logging.getLogger(__name__)

_LEGACY_SPLIT = "969, 30, 1"
"""Megatron-LM's ``--split`` when ``--data-path`` is given without one (``validate_args``)."""


def check_data_split(data_path: Sequence[str] | None, split: str | None, mock: bool) -> None:
    """``ValueError`` when ``--split`` leaves a split of positive weight without a sequence of a
    single ``--data-path`` prefix.

    megatron-core splits a GPT data set by sequence (one per document as written by
    ``gnmr-prepare-data``): split ``i`` holds sequences ``round(b_i n)`` to ``round(e_i n)``.
    An empty one never finishes building: ``GPTDataset._get_num_epochs`` adds epochs of zero
    tokens until the requested tokens are reached, so the run would hang before its first
    step. A blend, mock data or a prefix not on this host is not checked.
    """
    if mock or not data_path or len(data_path) != 1 or not Path(data_path[0] + ".idx").is_file():
        return
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, split = data_path[0], split or _LEGACY_SPLIT
    n = _sequence_count(prefix, IndexedDataset)
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for name, bounds in zip(("train", "valid", "test"), matrix, strict=True):
        if bounds is not None and round(bounds[0] * n) == round(bounds[1] * n):
            raise ValueError(
                f"--data-path {prefix} holds {n} sequences and --split {split!r} leaves the "
                f"{name} split none of them: megatron-core would loop forever building that "
                f"empty split. Write more documents (gnmr-prepare-data writes one per file) or "
                f"give the {name} split weight 0"
            )


def _sequence_count(prefix: str, indexed_dataset: Any) -> int:
    """The sequences in ``prefix.idx``, read by megatron-core's own ``IndexedDataset``;
    ``ValueError`` naming ``--data-path`` when the file is not an index it can read (another
    format, a truncated write). The header is checked first: megatron's reader asserts on it
    after building half an object, whose finalizer then prints a second traceback."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER

    idx = Path(prefix + ".idx")
    fix = "write it again with gnmr-prepare-data (or megatron's tools/preprocess_data.py)"
    with idx.open("rb") as stream:
        head = stream.read(len(_INDEX_HEADER) + 8 + 1 + 8 + 8)  # header, version, dtype, counts
    if len(head) < len(_INDEX_HEADER) + 25 or not head.startswith(_INDEX_HEADER):
        raise ValueError(f"--data-path {prefix}: {idx} is not a megatron-core index file: {fix}")
    try:
        return len(indexed_dataset(prefix, mmap=True).sequence_lengths)
    except (AssertionError, ValueError, OSError, struct.error) as err:
        raise ValueError(
            f"--data-path {prefix}: megatron-core cannot read {idx} ({err}): {fix}"
        ) from None


def check_args(argv: Sequence[str], world_size: int, check_host: bool = True) -> None:
    """Check ``argv`` as a launch of ``world_size`` processes would run it, in this process.

    megatron's own ``parse_args`` (with :func:`add_gnmr_args`) and ``validate_args`` (layout,
    batch sizes, precision flags), then the GNMR block and the spike options. ``check_host``:
    also what depends on this machine (no CUDA: the CPU flags; a backend it cannot load).
    Raises ``ValueError`` (megatron's assertion message, or GNMR's); an unknown or malformed
    flag exits through argparse (status 2, message on stderr), as megatron itself would.
    """
    import contextlib
    import io
    import os

    require_training(argv)  # megatron.training and the modules this argument set needs
    argv = megatron_flags.customary_argv(argv)
    if not torch.cuda.is_available():
        from gnmr_dist.testing.megatron_cpu import enable_cpu_compat

        argv = megatron_flags.cpu_argv(argv) if check_host else argv
        enable_cpu_compat(training=True)  # validate_args asks torch.cuda for the device arch
    from megatron.training.arguments import parse_args, validate_args

    saved = sys.argv, {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    sys.argv = ["gnmr-megatron-pretrain", *argv]
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # megatron prints every argument
            args = parse_args(megatron_flags.add_gnmr_args)
            validate_args(args, {})
    except AssertionError as err:
        raise ValueError(f"megatron: {err}") from None
    finally:
        sys.argv = saved[0]
        for key, value in saved[1].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _check_batches(args)
    check_data_split(args.data_path, args.split, args.mock_data)
    megatron_flags.gnmr_block(args, check_host=check_host)
    if args.gnmr_inject_grad_spike:
        from gnmr_dist.testing.drills import parse_spikes

        parse_spikes(args.gnmr_inject_grad_spike)


def _check_batches(args: argparse.Namespace) -> None:
    """megatron's own micro-batch calculator for the parsed sizes (what ``pretrain`` builds
    first, after ``validate_args``), built and dropped again."""
    from megatron.core import num_microbatches_calculator as calculator

    try:
        calculator._build_num_microbatches_calculator(
            0,
            args.rampup_batch_size,
            args.global_batch_size,
            args.micro_batch_size,
            args.data_parallel_size,
            args.decrease_batch_size_if_needed,
        )
    except AssertionError as err:
        raise ValueError(f"megatron: {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``gnmr-megatron-pretrain``: Megatron-LM's ``pretrain`` for GPT with GNMR."""
    setup_logging()  # every rank at INFO: megatron's own logs come from the last rank
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        require_training(words)  # before anything is built: each module megatron will import
        extra_args_provider = megatron_flags.attach_from_argv(argv=words)
        given = megatron_flags.gnmr_namespace(sys.argv[1:])  # what attach left for megatron
        check_data_split(given.data_path, given.split, given.mock_data)
    except ValueError as err:
        logger.error("%s", err)
        return 2
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    pretrain(
        megatron_gpt.datasets_provider,
        megatron_gpt.model_provider,
        ModelType.encoder_or_decoder,
        megatron_gpt.forward_step,
        extra_args_provider=extra_args_provider,
    )
    from gnmr_dist.distributed.teardown import close_distributed

    close_distributed()  # barrier, groups destroyed, gloo's workers idle before the exit
    return 0
