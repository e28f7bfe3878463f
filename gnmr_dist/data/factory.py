"""`make_dataset`: one entry point from a spec string to a dataset of fixed-length samples."""

from __future__ import annotations

from pathlib import Path

from gnmr_dist.data.corpus import SPLITS, embedded_corpus
from gnmr_dist.data.datasets import MegatronIndexedDataset, TextTokenDataset, TokenStreamDataset
from gnmr_dist.data.tokenizer import Tokenizer, as_tokenizer

__all__ = ["embedded_files", "is_embedded", "make_dataset"]


def _parse_embedded(spec: str) -> tuple[str, str | None]:
    parts = spec.split(":")
    if len(parts) > 3 or parts[0] != "embedded":
        raise ValueError(f"embedded spec is 'embedded[:split[:domain]]', got {spec!r}")
    split = parts[1] if len(parts) > 1 and parts[1] else "train"
    if split not in SPLITS:
        raise ValueError(f"split in {spec!r} must be one of {SPLITS}, got {split!r}")
    domain = parts[2] if len(parts) > 2 and parts[2] else None
    return split, domain


def is_embedded(spec: str) -> bool:
    """Whether `spec` names the embedded corpus (`"embedded[:split[:domain]]"`)."""
    return spec == "embedded" or spec.startswith("embedded:")


def embedded_files(spec: str, max_bytes: int | None = None) -> list[Path]:
    """The files an `"embedded[:split[:domain]]"` spec selects (at most `max_bytes` in all)."""
    split, domain = _parse_embedded(spec)
    files = embedded_corpus(split, domain=domain, max_bytes=max_bytes)
    if not files:
        raise ValueError(f"{spec!r} with max_bytes={max_bytes} selects no files")
    return files


def make_dataset(
    spec: str | Path,
    seq_len: int,
    tokenizer: Tokenizer | str | Path | None = None,
    *,
    max_bytes: int | None = None,
) -> TokenStreamDataset:
    """Build the dataset named by `spec` (see `gnmr_dist.data` for the spec grammar).

    `tokenizer`: None (bytes), a tokenizer object, or a local Hugging Face tokenizer directory.
    `max_bytes` caps the embedded corpus (ignored by other sources). A megatron prefix holds
    token ids already, so `tokenizer` is not used for it.
    """
    tok = as_tokenizer(tokenizer)
    spec = str(spec)
    if is_embedded(spec):
        return TextTokenDataset(embedded_files(spec, max_bytes), tok, seq_len)
    if Path(spec + ".bin").is_file() and Path(spec + ".idx").is_file():
        return MegatronIndexedDataset(spec, seq_len)
    return TextTokenDataset(spec, tok, seq_len)
