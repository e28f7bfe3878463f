"""``gnmr-prepare-data SPEC PREFIX``: a text source as a megatron-core indexed dataset.

Writes ``PREFIX.bin`` / ``PREFIX.idx`` (:func:`gnmr_dist.data.write_indexed_dataset`) holding the
token stream ``gnmr-ds-pretrain --data SPEC`` trains on, for ``gnmr-megatron-pretrain
--data-path PREFIX`` (with the default bytes: ``--tokenizer-type NullTokenizer --vocab-size
256``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gnmr_dist.data import write_indexed_dataset


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gnmr-prepare-data", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="embedded[:split[:domain]], a glob, a file or a directory")
    p.add_argument("prefix", help="output prefix: PREFIX.bin and PREFIX.idx are written")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="LOCAL Hugging Face tokenizer directory (default: bytes)",
    )
    p.add_argument("--max-bytes", type=int, default=None, help="cap on the embedded corpus")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tokens = write_indexed_dataset(
            args.spec, args.prefix, args.tokenizer, max_bytes=args.max_bytes
        )
    except (OSError, ValueError, ImportError) as err:
        print(f"gnmr-prepare-data: {err}", file=sys.stderr)
        return 2
    print(f"gnmr-prepare-data: wrote {args.prefix}.bin/.idx ({tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
