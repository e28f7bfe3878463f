"""Training data for gnmr-dist experiments: tokenizers, a built-in corpus and datasets.

Everything yields fixed-length samples of `seq_len + 1` int64 tokens (inputs `[:-1]`,
targets `[1:]`) with stride `seq_len` over one concatenated token stream in which every
document ends with the tokenizer's end-of-document id (details in `datasets.py`).

One entry point, `make_dataset(spec, seq_len, tokenizer=None, *, max_bytes=None)`; `spec` is:

- `"embedded"`, `"embedded:heldout"`, `"embedded:train:email"` -- `embedded[:split[:domain]]`:
  the running interpreter's standard-library sources, no download (`corpus.py`: split by a
  stable hash of the relative path, 2% heldout; domain = a top-level subpackage).
- `"PREFIX"` where `PREFIX.bin` and `PREFIX.idx` exist -- a megatron-core indexed dataset of
  token ids (read with megatron-core's own `IndexedDataset`).
- anything else -- a glob (`"corpus/**/*.txt"`), a file or a directory of text files, sorted.

`tokenizer` is None (`ByteTokenizer`: bytes 0-255, EOD = 256, PAD = 257), a tokenizer
object, or the path of a LOCAL Hugging Face tokenizer directory (`load_tokenizer`; nothing is
downloaded). megatron-core and transformers are imported only when used.

`write_indexed_dataset(spec, prefix)` writes the same token stream as a megatron-core indexed
dataset, for `gnmr-megatron-pretrain --data-path PREFIX` (`indexed.py`;
`gnmr-prepare-data SPEC PREFIX` on the command line).
"""

from gnmr_dist.data.corpus import HELDOUT_FRACTION, embedded_corpus
from gnmr_dist.data.datasets import MegatronIndexedDataset, TextTokenDataset, TokenStreamDataset
from gnmr_dist.data.factory import make_dataset
from gnmr_dist.data.indexed import write_indexed_dataset
from gnmr_dist.data.tokenizer import (
    EOD_ID,
    PAD_ID,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "EOD_ID",
    "HELDOUT_FRACTION",
    "PAD_ID",
    "ByteTokenizer",
    "HFTokenizer",
    "MegatronIndexedDataset",
    "TextTokenDataset",
    "TokenStreamDataset",
    "Tokenizer",
    "embedded_corpus",
    "load_tokenizer",
    "make_dataset",
    "write_indexed_dataset",
]
