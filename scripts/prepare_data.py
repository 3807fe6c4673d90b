"""Turn text into a memory-mapped token file that train.py reads.

  python scripts/prepare_data.py                                   # pydoc topics, bytes
  python scripts/prepare_data.py --sources pydoc stdlib --tokenizer bpe --bpe-vocab-size 8192 \
      --out outputs/data/stdlib-bpe8k
  python scripts/prepare_data.py --sources my_corpus/ --tokenizer hf:/models/llama3/tokenizer.json --out /data/l3
  python scripts/prepare_data.py --sources my_corpus/ more.jsonl --out /data/mine
  python scripts/prepare_data.py --validation-fraction 0.1 --force   # hold 10% of the documents out

Tokenizers: byte, bpe (trained here on the sources), or hf:FILE, a local tokenizer.json (a
tokenizer_config.json beside it names the end-of-document token); train with the same
data.tokenizer value.
Sources: "pydoc" and "stdlib" are built in (offline); anything else is a .txt file (one
document), a .jsonl file (one {"text": ...} document per line) or a folder of them.
--validation-fraction F keeps about F of the documents (chosen by a hash of their text) out
of training, in OUT/validation, for data.validation=held_out.
"""

import argparse
import sys
import time
from pathlib import Path

from data.token_file import prepare_token_file


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/data/pydoc-byte", help="output folder")
    parser.add_argument("--sources", nargs="+", default=["pydoc"])
    parser.add_argument("--tokenizer", default="byte", help="byte | bpe | hf:/path/to/tokenizer.json")
    parser.add_argument("--bpe-vocab-size", type=int, default=4096)
    parser.add_argument("--validation-fraction", type=float, default=0.0,
                        help="fraction of documents held out for validation, in OUT/validation (default 0)")
    parser.add_argument("--force", action="store_true", help="replace an existing dataset")
    args = parser.parse_args(argv)

    out = Path(args.out)
    if out.exists():
        if not args.force:
            print(f"{out} exists; pass --force to rebuild it", file=sys.stderr)
            return 1
        import shutil
        shutil.rmtree(out)
    start = time.perf_counter()
    meta = prepare_token_file(out, args.sources, args.tokenizer, args.bpe_vocab_size,
                              validation_fraction=args.validation_fraction)
    print(f"wrote {out}: {meta.num_tokens:,} tokens from {meta.num_documents:,} documents, "
          f"tokenizer {meta.tokenizer} (vocab {meta.vocab_size}), {meta.dtype}, "
          f"sha256 {meta.sha256[:16]}..., {time.perf_counter() - start:.1f} s")
    if meta.validation:
        v = meta.validation
        print(f"held out for validation in {out / v['path']}: {v['num_tokens']:,} tokens from "
              f"{v['num_documents']:,} documents (fraction {v['fraction']:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
