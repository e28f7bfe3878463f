"""The embedded stdlib corpus: deterministic, disjoint splits, domain filter, size cap."""

from __future__ import annotations

import hashlib
import os

import pytest

from gnmr_dist.data import embedded_corpus
from gnmr_dist.data.corpus import stdlib_root


def _reference_split():
    """Independent listing (os.walk) and hash split of the stdlib sources."""
    root = stdlib_root()
    train, heldout = [], []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in {"site-packages", "dist-packages", "__pycache__"}]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                h = int(hashlib.sha256(rel.encode()).hexdigest()[:16], 16)
                (heldout if h / 2**64 < 0.02 else train).append(rel)
    return sorted(train), sorted(heldout)


def _rel(paths):
    return [p.relative_to(stdlib_root()).as_posix() for p in paths]


def test_splits_deterministic_disjoint_and_match_reference():
    train, heldout = embedded_corpus("train"), embedded_corpus("heldout")
    assert embedded_corpus("train") == train and embedded_corpus("heldout") == heldout
    ref_train, ref_heldout = _reference_split()
    assert _rel(train) == ref_train
    assert _rel(heldout) == ref_heldout
    assert not set(train) & set(heldout)
    assert len(train) > 500
    frac = len(heldout) / (len(train) + len(heldout))
    assert 0.01 <= frac <= 0.04, frac
    assert not any("site-packages" in p.parts for p in train + heldout)


def test_domain_filter():
    email = embedded_corpus("train", domain="email")
    rels = _rel(email)
    assert rels and all(r.startswith("email/") for r in rels)
    ref = [r for r in _reference_split()[0] if r.startswith("email/")]
    assert rels == ref
    assert embedded_corpus("train", domain="email/") == email
    with pytest.raises(ValueError, match="no-such-domain"):
        embedded_corpus("train", domain="no-such-domain")
    with pytest.raises(ValueError, match="split must be one of"):
        embedded_corpus("test")


def test_max_bytes_is_a_sorted_prefix():
    full = embedded_corpus("train", domain="json")
    assert len(full) >= 2
    sizes = [p.stat().st_size for p in full]
    cap = sizes[0] + sizes[1]
    capped = embedded_corpus("train", domain="json", max_bytes=cap)
    assert capped == full[:2]
    assert sum(p.stat().st_size for p in capped) <= cap
