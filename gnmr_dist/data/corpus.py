"""A default corpus that needs no download: the running interpreter's own standard library.

`embedded_corpus` lists the `*.py` files under `sysconfig.get_paths()["stdlib"]` (without any
`site-packages`/`dist-packages` inside it), sorted by relative path, so the list depends only
on the Python build (CPython 3.11: ~1,800 files, ~31 MB).

Split: a file is "heldout" when the first 8 bytes of SHA-256 of its relative POSIX path, taken
as an integer, fall below `HELDOUT_FRACTION` (2%) of 2**64; otherwise it is "train". The hash
of the path (not the position in the list) keeps a file's split fixed when other files come or
go, and the two splits are disjoint by construction.

Domain: `domain="email"` keeps only files under `email/` (a top-level subpackage), so an
experiment can pretrain without a domain and fine-tune or evaluate on it.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

__all__ = ["HELDOUT_FRACTION", "SPLITS", "embedded_corpus", "stdlib_root"]

HELDOUT_FRACTION = 0.02
"""Expected share of files in the "heldout" split."""
SPLITS = ("train", "heldout")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_heldout(rel: str) -> bool:
    """Stable split of one relative path (see the module docstring)."""
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
    return h < HELDOUT_FRACTION * 2**64


def _all_files(root: Path) -> list[tuple[str, Path]]:
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not _EXCLUDED_DIRS & set(rel.parts) and p.is_file():
            files.append((rel.as_posix(), p))
    return sorted(files)


def embedded_corpus(
    split: str = "train", domain: str | None = None, max_bytes: int | None = None
) -> list[Path]:
    """The stdlib source files of one split, sorted, optionally one domain and a size cap.

    `domain` is a top-level subpackage ("email", "json", "asyncio", ...; a trailing "/" is
    allowed). `max_bytes` keeps the longest sorted prefix whose total size is <= max_bytes.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    files = [
        (rel, p) for rel, p in _all_files(stdlib_root()) if _is_heldout(rel) == (split == "heldout")
    ]
    if domain is not None:
        prefix = domain.strip("/") + "/"
        available = sorted({rel.split("/")[0] for rel, _ in files if "/" in rel})
        files = [(rel, p) for rel, p in files if rel.startswith(prefix)]
        if not files:
            raise ValueError(
                f"no {split!r} files under domain {domain!r} in {stdlib_root()}; "
                f"domains: {', '.join(available)}"
            )
    out, total = [], 0
    for _, p in files:
        size = p.stat().st_size
        if max_bytes is not None and total + size > max_bytes:
            break
        out.append(p)
        total += size
    return out
