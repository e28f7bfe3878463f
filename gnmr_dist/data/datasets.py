"""Fixed-length language-model samples from one long token stream.

Every dataset here reduces its source to ONE 1-D token tensor in memory (uint16 when the
vocabulary fits, else int32; ~2 bytes a token) in which documents are concatenated with the
tokenizer's end-of-document id after each one:

    tokens = doc_0 EOD doc_1 EOD ... doc_{n-1} EOD

Sample i is `tokens[i * seq_len : i * seq_len + seq_len + 1]` as int64, so inputs are
`sample[:-1]` and targets `sample[1:]`; consecutive samples share exactly one token (stride
`seq_len`) and every token is a target once. There are `(len(tokens) - 1) // seq_len`
samples; the tail that does not fill one is dropped. Samples cross document boundaries, as in
GPT-style pretraining; the EOD id tells the model where one document ends.

Sources: text files (`TextTokenDataset`) and megatron-core indexed datasets
(`MegatronIndexedDataset`, read through megatron-core's own `IndexedDataset`).
"""

from __future__ import annotations

import glob as _glob
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils.data import Dataset

from gnmr_dist.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "MegatronIndexedDataset",
    "TextTokenDataset",
    "TokenStreamDataset",
    "encode_file",
    "resolve_paths",
]


def _storage_dtype(vocab_size: int) -> torch.dtype:
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


class TokenStreamDataset(Dataset[torch.Tensor]):
    """Samples of `seq_len + 1` tokens with stride `seq_len` over one token tensor."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, source: str = "tokens") -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"{source} holds {tokens.numel()} tokens; one sample of seq_len={seq_len} "
                f"needs at least {seq_len + 1}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.source = source

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, idx: int) -> torch.Tensor:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples")
        start = (idx % n) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].to(torch.int64)


def resolve_paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """A glob, a file, a directory (its files, recursively) or a list of them -> sorted files."""
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not items:
        raise ValueError("no input files given (empty list)")
    out: set[Path] = set()
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = [f for f in p.rglob("*") if f.is_file()]
        elif p.is_file():
            found = [p]
        else:
            found = [Path(f) for f in _glob.glob(str(item), recursive=True) if Path(f).is_file()]
        if not found:
            raise FileNotFoundError(f"no files match {str(item)!r}")
        out.update(found)
    return sorted(out)


def encode_file(path: Path, tokenizer: Tokenizer) -> torch.Tensor:
    """One document's token ids (int64): raw bytes for `ByteTokenizer`, else UTF-8 text."""
    data = path.read_bytes()
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode_bytes(data)
    text = data.decode("utf-8", errors="replace")
    return torch.tensor(tokenizer.encode(text), dtype=torch.int64)


class TextTokenDataset(TokenStreamDataset):
    """Text files (sorted) tokenized and concatenated, EOD after each, as fixed samples.

    `paths`: a glob ("data/*.txt", "**" allowed), a file, a directory or a list of them.
    `tokenizer`: None for `ByteTokenizer` (raw bytes, any encoding); other tokenizers get the
    file decoded as UTF-8 (invalid bytes become U+FFFD).
    """

    def __init__(
        self,
        paths: str | Path | Iterable[str | Path],
        tokenizer: Tokenizer | None,
        seq_len: int,
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.paths = resolve_paths(paths)
        eod = torch.tensor([self.tokenizer.eod_id], dtype=torch.int64)
        dtype = _storage_dtype(self.tokenizer.vocab_size)
        parts: list[torch.Tensor] = []
        for p in self.paths:
            parts += [encode_file(p, self.tokenizer).to(dtype), eod.to(dtype)]
        source = str(paths) if isinstance(paths, (str, Path)) else f"{len(self.paths)} files"
        super().__init__(torch.cat(parts), seq_len, source=source)


class MegatronIndexedDataset(TokenStreamDataset):
    """A megatron-core indexed dataset (PREFIX.bin + PREFIX.idx) as fixed samples.

    Read with `megatron.core.datasets.indexed_dataset.IndexedDataset`; the documents are
    concatenated in order. Megatron's preprocessing usually appends EOD already
    (`--append-eod`), so by default nothing is inserted; pass `eod_id` to write one after
    every document.
    """

    def __init__(self, prefix: str | Path, seq_len: int, *, eod_id: int | None = None) -> None:
        prefix = str(prefix)
        missing = [f for f in (prefix + ".bin", prefix + ".idx") if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"megatron indexed dataset {prefix!r} needs {prefix}.bin and {prefix}.idx; "
                f"missing: {', '.join(missing)}"
            )
        try:
            import numpy as np
            from megatron.core.datasets.indexed_dataset import IndexedDataset
        except ImportError as e:
            raise ImportError(
                "MegatronIndexedDataset needs megatron-core: pip install megatron-core"
            ) from e
        ds = IndexedDataset(prefix, mmap=True)
        flat = np.concatenate(ds[0 : len(ds)]) if len(ds) else np.zeros(0, dtype=np.int64)
        if eod_id is not None:
            starts = np.concatenate([[0], np.cumsum(ds.sequence_lengths, dtype=np.int64)])
            flat = np.insert(flat, starts[ds.document_indices[1:]], eod_id)
        dtype = np.int64 if flat.dtype == np.int64 else np.int32
        self.prefix = prefix
        super().__init__(torch.from_numpy(flat.astype(dtype)), seq_len, source=prefix)
