"""Fixed-length samples from text files and megatron indexed datasets, and make_dataset."""

from __future__ import annotations

import pytest
import torch

from gnmr_dist.data import (
    EOD_ID,
    MegatronIndexedDataset,
    TextTokenDataset,
    embedded_corpus,
    make_dataset,
)

DOCS = {"b.txt": "hello", "a.txt": "xyz\n", "c.txt": "é!"}  # read in sorted order: a, b, c


def _write_docs(tmp_path):
    for name, text in DOCS.items():
        (tmp_path / name).write_bytes(text.encode("utf-8"))


def _reference_stream():
    out = []
    for name in sorted(DOCS):
        out += [*DOCS[name].encode("utf-8"), EOD_ID]
    return out


def test_text_dataset_samples_are_slices_of_concatenation(tmp_path):
    _write_docs(tmp_path)
    ref = _reference_stream()
    assert len(ref) == 4 + 1 + 5 + 1 + 3 + 1 == 15
    ds = TextTokenDataset(str(tmp_path / "*.txt"), None, seq_len=4)
    assert ds.tokens.dtype == torch.uint16
    assert ds.tokens.tolist() == ref
    assert len(ds) == (15 - 1) // 4 == 3
    for i in range(len(ds)):
        s = ds[i]
        assert s.dtype == torch.int64 and s.shape == (5,)
        assert s.tolist() == ref[4 * i : 4 * i + 5]
    # stride seq_len: last token of sample i is the first of sample i + 1
    assert ds[0][-1] == ds[1][0] == ref[4] == EOD_ID
    assert ds[-1].tolist() == ref[8:13]
    with pytest.raises(IndexError):
        ds[3]
    # a list of files and a directory give the same stream
    same = TextTokenDataset([tmp_path / n for n in ("c.txt", "a.txt", "b.txt")], None, 4)
    assert same.tokens.tolist() == ref
    assert TextTokenDataset(tmp_path, None, 4).tokens.tolist() == ref


def test_text_dataset_errors(tmp_path):
    _write_docs(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no files match .*\*\.md"):
        TextTokenDataset(str(tmp_path / "*.md"), None, 4)
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        TextTokenDataset([tmp_path / "a.txt", tmp_path / "missing.txt"], None, 4)
    with pytest.raises(ValueError, match="empty list"):
        TextTokenDataset([], None, 4)
    with pytest.raises(ValueError, match=r"a\.txt.* 5 tokens; .*seq_len=5 needs at least 6"):
        TextTokenDataset(str(tmp_path / "a.txt"), None, 5)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        TextTokenDataset(str(tmp_path / "a.txt"), None, 0)


def _write_megatron(prefix, docs, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_megatron_indexed_round_trip(tmp_path):
    import numpy as np

    docs = [[5, 6, 7, 8, 9], [100, 101, 102], [40000, 3, 2, 1]]
    prefix = str(tmp_path / "corpus_text_document")
    _write_megatron(prefix, docs, np.uint16)
    flat = [t for d in docs for t in d]
    ds = MegatronIndexedDataset(prefix, seq_len=3)
    assert ds.tokens.tolist() == flat
    assert len(ds) == (12 - 1) // 3 == 3
    assert [ds[i].tolist() for i in range(3)] == [flat[0:4], flat[3:7], flat[6:10]]
    # eod_id written after every document
    with_eod = MegatronIndexedDataset(prefix, seq_len=3, eod_id=0)
    assert with_eod.tokens.tolist() == [*docs[0], 0, *docs[1], 0, *docs[2], 0]
    # make_dataset picks the prefix when both files exist
    auto = make_dataset(prefix, 3)
    assert isinstance(auto, MegatronIndexedDataset)
    assert torch.equal(auto.tokens, ds.tokens)


def test_megatron_missing_files_error(tmp_path):
    prefix = str(tmp_path / "nothing")
    (tmp_path / "nothing.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"nothing\.bin and .*nothing\.idx; missing: .*idx"):
        MegatronIndexedDataset(prefix, 4)


def test_make_dataset_embedded_specs():
    cap = 50_000
    ds = make_dataset("embedded:train:json", 64, max_bytes=cap)
    files = embedded_corpus("train", domain="json", max_bytes=cap)
    ref = []
    for p in files:
        ref += [*p.read_bytes(), EOD_ID]
    assert ds.tokens.tolist() == ref
    assert len(ds) == (len(ref) - 1) // 64
    assert torch.equal(ds[2], torch.tensor(ref[128:193]))
    held = make_dataset("embedded:heldout", 64, max_bytes=cap)
    assert held.tokens.numel() > 64
    assert torch.equal(
        make_dataset("embedded", 64, max_bytes=cap).tokens[:100],
        TextTokenDataset(embedded_corpus("train")[:1], None, 64).tokens[:100],
    )
    with pytest.raises(ValueError, match="split in 'embedded:test'"):
        make_dataset("embedded:test", 64)
