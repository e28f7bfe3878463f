"""Byte tokenizer round trip and the local Hugging Face tokenizer path (no downloads)."""

from __future__ import annotations

import pytest
import torch

from gnmr_dist.data import (
    EOD_ID,
    PAD_ID,
    ByteTokenizer,
    TextTokenDataset,
    load_tokenizer,
    make_dataset,
)

WORDS = ["def", "return", "import", "class", "self", "x", "="]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ∑ 🙂'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert len(ids) == len(text.encode("utf-8")) == 39
    assert max(ids) < 256
    assert tok.decode(ids) == text
    # special ids are dropped on decode and sit above the bytes
    assert (EOD_ID, PAD_ID, tok.vocab_size) == (256, 257, 258)
    assert tok.decode([*ids[:3], EOD_ID, PAD_ID]) == "def"
    assert tok.encode_bytes(text.encode("utf-8")).tolist() == ids
    assert tok.encode_bytes(b"").numel() == 0


def _save_tiny_hf_tokenizer(path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    raw = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="<eos>")
    hf.save_pretrained(str(path))
    return vocab


def test_local_hf_tokenizer(tmp_path):
    vocab = _save_tiny_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.eod_id == vocab["<eos>"] == 1
    assert tok.vocab_size == len(vocab) == 9
    ids = tok.encode("class x = self zzz")
    assert ids == [vocab["class"], vocab["x"], vocab["="], vocab["self"], 0]
    assert tok.decode(ids[:4]).split() == ["class", "x", "=", "self"]

    (tmp_path / "a.txt").write_text("def x")
    (tmp_path / "b.txt").write_text("return self")
    ds = TextTokenDataset(str(tmp_path / "*.txt"), tok, seq_len=2)
    # def x EOD return self EOD -> [2, 7, 1, 3, 6, 1]; samples at stride 2
    assert ds.tokens.tolist() == [2, 7, 1, 3, 6, 1]
    assert [ds[i].tolist() for i in range(len(ds))] == [[2, 7, 1], [1, 3, 6]]
    # make_dataset takes the directory path directly
    ds2 = make_dataset(str(tmp_path / "*.txt"), 2, str(tmp_path / "tok"))
    assert torch.equal(ds2.tokens, ds.tokens)


def test_missing_hf_tokenizer_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_dataset("embedded", 8, missing)
