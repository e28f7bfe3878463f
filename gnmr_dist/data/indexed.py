"""`write_indexed_dataset`: any text source of `make_dataset` as a megatron-core indexed dataset.

Megatron-LM's training loop (`gnmr-megatron-pretrain --data-path PREFIX`) reads token ids from
`PREFIX.bin` / `PREFIX.idx`. This writes them from the same sources and the same tokenizer as
the DeepSpeed program's datasets, one megatron document per file with the end-of-document id
appended (what Megatron-LM's `preprocess_data.py --append-eod` writes). Megatron's `GPTDataset`
then draws its samples from the stream

    doc_0 EOD doc_1 EOD ... doc_{n-1} EOD

which is `TextTokenDataset`'s stream for the same spec token for token, so both programs train
on one corpus (with `--tokenizer-type NullTokenizer --vocab-size 256` for the default bytes:
NullTokenizer's EOD id is its vocabulary size, 256 = `ByteTokenizer`'s).
"""

from __future__ import annotations

from pathlib import Path

from gnmr_dist.data.datasets import encode_file, resolve_paths
from gnmr_dist.data.factory import embedded_files, is_embedded
from gnmr_dist.data.tokenizer import Tokenizer, as_tokenizer

__all__ = ["write_indexed_dataset"]


def write_indexed_dataset(
    spec: str | Path,
    prefix: str | Path,
    tokenizer: Tokenizer | str | Path | None = None,
    *,
    max_bytes: int | None = None,
) -> int:
    """Write `PREFIX.bin` and `PREFIX.idx` from the text source `spec` (`"embedded[:split]"`,
    a glob, a file or a directory; see `gnmr_dist.data`); the number of tokens written.

    Imports megatron-core (its `IndexedDatasetBuilder` writes the format it reads); int32 ids.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = as_tokenizer(tokenizer)
    spec = str(spec)
    files = embedded_files(spec, max_bytes) if is_embedded(spec) else resolve_paths(spec)
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    written = 0
    for path in files:
        ids = [*encode_file(Path(path), tok).tolist(), tok.eod_id]
        builder.add_document(np.asarray(ids, dtype=np.int32), [len(ids)])
        written += len(ids)
    builder.finalize(prefix + ".idx")
    return written
