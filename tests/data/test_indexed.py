"""gnmr_dist.data.write_indexed_dataset: the DeepSpeed program's token stream for Megatron-LM."""

import pytest
import torch

from gnmr_dist.data import MegatronIndexedDataset, make_dataset, write_indexed_dataset
from tests.requires import require

require("megatron.core", reason="writes with megatron-core's IndexedDatasetBuilder")


@pytest.mark.parametrize("spec", ["embedded", "embedded:heldout", "TEXTS"])
def test_megatron_reads_the_stream_the_deepspeed_program_trains_on(tmp_path, spec):
    if spec == "TEXTS":
        for i, text in enumerate(["first doc", "zweites Dokument \u00e9", "", "third"]):
            (tmp_path / "texts").mkdir(exist_ok=True)
            (tmp_path / "texts" / f"{i}.txt").write_text(text, encoding="utf-8")
        spec = str(tmp_path / "texts")
    written = write_indexed_dataset(spec, tmp_path / "out" / "doc", max_bytes=60_000)
    ours = make_dataset(spec, 16, max_bytes=60_000)
    theirs = MegatronIndexedDataset(tmp_path / "out" / "doc", 16)
    assert written == ours.tokens.numel() == theirs.tokens.numel()
    assert torch.equal(ours.tokens.long(), theirs.tokens.long())  # EOD (256) after every file
    assert int((theirs.tokens == 256).sum()) == len(ours.paths)
    assert [theirs[i].tolist() for i in (0, len(theirs) - 1)] == [
        ours[i].tolist() for i in (0, len(ours) - 1)
    ]


def test_a_split_without_a_sequence_is_refused_before_megatron_loops_on_it(tmp_path):
    """megatron-core never finishes building a split of positive weight that holds no
    sequence; ``gnmr-megatron-pretrain`` refuses it first, naming the split."""
    from gnmr_dist.train.megatron_lm import check_data_split

    (tmp_path / "texts").mkdir()
    for i in range(12):
        (tmp_path / "texts" / f"{i:02}.txt").write_text(f"document {i}")
    write_indexed_dataset(tmp_path / "texts", tmp_path / "doc")
    prefix = str(tmp_path / "doc")
    said = r"holds 12 sequences and --split '90,5,5' leaves the valid split none of them"
    with pytest.raises(ValueError, match=said):
        check_data_split([prefix], "90,5,5", mock=False)
    with pytest.raises(ValueError, match=r"--split '969, 30, 1' leaves the valid split"):
        check_data_split([prefix], None, mock=False)  # Megatron-LM's legacy default
    check_data_split([prefix], "50,50,0", mock=False)  # 6 and 6 sequences, no test split
    check_data_split(["0.5", prefix, "0.5", prefix], "90,5,5", mock=False)  # a blend: not read
    check_data_split([prefix], "90,5,5", mock=True)
    check_data_split([str(tmp_path / "elsewhere")], "90,5,5", mock=False)  # not on this host


def test_an_index_megatron_cannot_read_is_refused_naming_the_data_path(tmp_path, capfd):
    """Another file under the ``.idx`` name, or one cut short, is a ``ValueError`` naming
    ``--data-path`` and the fix, not megatron's assertion (and its finalizer's traceback)."""
    from gnmr_dist.train.megatron_lm import check_data_split

    (tmp_path / "texts").mkdir()
    for i in range(12):
        (tmp_path / "texts" / f"{i:02}.txt").write_text(f"document {i}")
    write_indexed_dataset(tmp_path / "texts", tmp_path / "doc")
    good = (tmp_path / "doc.idx").read_bytes()
    prefix = str(tmp_path / "bad")
    (tmp_path / "bad.bin").write_bytes((tmp_path / "doc.bin").read_bytes())
    for text in (b"not an index at all", good[:20], good[:40]):
        (tmp_path / "bad.idx").write_bytes(text)
        with pytest.raises(ValueError, match=rf"--data-path {prefix}: .*write it again with gnmr"):
            check_data_split([prefix], "90,5,5", mock=False)
    assert "Traceback" not in capfd.readouterr().err
