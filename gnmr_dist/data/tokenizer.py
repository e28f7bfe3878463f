"""Tokenizers for the training data: raw bytes by default, a local Hugging Face one on request.

`ByteTokenizer` needs nothing: a token is a byte value (0-255) and two special ids sit above
the bytes, `EOD_ID = 256` (end of document, written after every document when documents are
concatenated) and `PAD_ID = 257` (padding, never produced by `encode`). The vocabulary is
therefore 258 and every id fits a uint16. Bytes make any text file trainable with no download,
at the cost of ~4x longer sequences than a subword tokenizer.

`load_tokenizer(path)` wraps a tokenizer saved with `save_pretrained` in a LOCAL directory
(`local_files_only=True`: nothing is ever fetched from a hub) behind the same small interface:
`encode(str) -> list[int]`, `decode(ids) -> str`, `vocab_size`, `eod_id`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "EOD_ID",
    "PAD_ID",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "as_tokenizer",
    "load_tokenizer",
]

EOD_ID = 256
"""End-of-document id of `ByteTokenizer`, written after every document of a concatenation."""
PAD_ID = 257
"""Padding id of `ByteTokenizer`; `encode` never produces it."""


class Tokenizer(Protocol):
    """What the datasets need from a tokenizer."""

    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Token = UTF-8 byte value (0-255); `EOD_ID` (256) and `PAD_ID` (257) are special."""

    vocab_size = 258
    eod_id = EOD_ID
    pad_id = PAD_ID

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text` as ids; no special ids are added."""
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> torch.Tensor:
        """Raw bytes (any encoding) as a uint8 tensor of ids, without a Python-level loop."""
        return (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer behind the `Tokenizer` interface (see `load_tokenizer`)."""

    def __init__(self, hf_tokenizer: Any, *, eod_id: int | None = None) -> None:
        self.hf = hf_tokenizer
        eod = eod_id if eod_id is not None else hf_tokenizer.eos_token_id
        if eod is None:
            raise ValueError(
                "the Hugging Face tokenizer has no eos_token; pass eod_id=<id> or save the "
                "tokenizer with eos_token set"
            )
        self.eod_id = int(eod)
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` without the tokenizer's own special tokens (BOS/EOS)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Ids back to text, special tokens dropped."""
        return str(self.hf.decode(list(ids), skip_special_tokens=True))


def load_tokenizer(path: str | Path, *, eod_id: int | None = None) -> HFTokenizer:
    """Load a tokenizer saved with `save_pretrained` in the local directory `path`.

    Never downloads (`local_files_only=True`). `eod_id` defaults to the tokenizer's eos id.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {str(path)!r} does not exist; give a local directory written "
            "by save_pretrained (nothing is downloaded)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is in the pinned requirements
        raise ImportError("load_tokenizer needs transformers: pip install transformers") from e
    return HFTokenizer(
        AutoTokenizer.from_pretrained(str(path), local_files_only=True), eod_id=eod_id
    )


def as_tokenizer(tokenizer: Tokenizer | str | Path | None) -> Tokenizer:
    """`tokenizer` as the datasets take it: None -> `ByteTokenizer()`, a path -> the local
    Hugging Face tokenizer there (`load_tokenizer`), a tokenizer object as it is."""
    if isinstance(tokenizer, (str, Path)):
        return load_tokenizer(tokenizer)
    return tokenizer if tokenizer is not None else ByteTokenizer()
