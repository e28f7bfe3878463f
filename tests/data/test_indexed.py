"""gnmr_dist.data.write_indexed_dataset: the DeepSpeed program's token stream for Megatron-LM."""

import pytest
import torch

from gnmr_dist.data import MegatronIndexedDataset, make_dataset, write_indexed_dataset

pytest.importorskip("megatron.core", reason="writes with megatron-core's IndexedDatasetBuilder")


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
