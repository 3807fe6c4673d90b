"""Turn text into a memory-mapped token file that train.py reads.

  python scripts/prepare_data.py                                   # pydoc topics, bytes
  python scripts/prepare_data.py --sources pydoc stdlib --tokenizer bpe --bpe-vocab-size 8192 \
      --out outputs/data/stdlib-bpe8k
  python scripts/prepare_data.py --sources my_corpus/ --tokenizer hf:/models/llama3/tokenizer.json --out /data/l3
  python scripts/prepare_data.py --sources my_corpus/ more.jsonl --out /data/mine
  python scripts/prepare_data.py --validation-fraction 0.1 --force   # hold 10% of the documents out
  python scripts/prepare_data.py --sources fineweb/ --text-column text --tokenizer hf:/models/llama3/tokenizer.json \
      --workers 16 --out /data/fw    # 16 processes, a folder of shards; rerun after a kill to finish it

Tokenizers: byte, bpe (trained here on the sources), or hf:FILE, a local tokenizer.json (a
tokenizer_config.json beside it names the end-of-document token); train with the same
data.tokenizer value.
Sources: "pydoc" and "stdlib" are built in (offline); anything else is a .txt file (one
document), a .jsonl, .jsonl.gz or .jsonl.zst file (one {"text": ...} document per line), a .parquet
file (one document per row; --text-column names the column) or a folder of them. A document without
text ("" or null, an empty .txt) is dropped, as datatrove drops it; a whitespace-only one is kept.
--workers N writes a folder of shards (data/prep/shards.py), the same for every N; a relaunch of the
same command finishes only the shards that are not complete.
--validation-fraction F keeps about F of the documents (chosen by a hash of their text) out
of training, in OUT/validation, for data.validation=held_out.
"""

import argparse
import sys
import time
from pathlib import Path

from data.formats.native import PLAN_FILE
from data.prep.shards import DEFAULT_SHARD_BYTES, prepare_shards
from data.prep.writer import prepare_token_file


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/data/pydoc-byte", help="output folder")
    parser.add_argument("--sources", nargs="+", default=["pydoc"])
    parser.add_argument("--tokenizer", default="byte", help="byte | bpe | hf:/path/to/tokenizer.json")
    parser.add_argument("--bpe-vocab-size", type=int, default=4096)
    parser.add_argument("--validation-fraction", type=float, default=0.0,
                        help="fraction of documents held out for validation, in OUT/validation (default 0)")
    parser.add_argument("--text-column", default="text", help="the text field of .jsonl records and .parquet rows")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenize in N processes into a folder of shards (resumable; the same for every N)")
    parser.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES,
                        help=f"input bytes per shard with --workers (default {DEFAULT_SHARD_BYTES})")
    parser.add_argument("--force", action="store_true", help="replace an existing dataset")
    args = parser.parse_args(argv)

    out = Path(args.out)
    resuming = args.workers is not None and (out / PLAN_FILE).is_file() and not args.force
    if out.exists() and not resuming:
        if not args.force:
            print(f"{out} exists; pass --force to rebuild it", file=sys.stderr)
            return 1
        import shutil
        shutil.rmtree(out)
    start = time.perf_counter()
    if args.workers is not None:
        return _sharded(args, out, start)
    meta = prepare_token_file(out, args.sources, args.tokenizer, args.bpe_vocab_size,
                              validation_fraction=args.validation_fraction, text_column=args.text_column)
    print(f"wrote {out}: {meta.num_tokens:,} tokens from {meta.num_documents:,} documents, "
          f"tokenizer {meta.tokenizer} (vocab {meta.vocab_size}), {meta.dtype}, "
          f"sha256 {meta.sha256[:16]}..., {time.perf_counter() - start:.1f} s")
    if meta.validation:
        v = meta.validation
        print(f"held out for validation in {out / v['path']}: {v['num_tokens']:,} tokens from "
              f"{v['num_documents']:,} documents (fraction {v['fraction']:g})")
    return 0


def _sharded(args, out: Path, start: float) -> int:
    try:
        t = prepare_shards(out, args.sources, args.tokenizer, args.bpe_vocab_size, args.validation_fraction,
                           args.text_column, args.workers, args.shard_bytes)
    except (ValueError, RuntimeError) as e:  # DataError is a ValueError: a changed request, bad input
        print(f"error: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    print(f"wrote {out}: {t['shards']} shard(s), {t['num_tokens']:,} tokens from {t['num_documents']:,} documents, "
          f"tokenizer {t['tokenizer']} (vocab {t['vocab_size']}), {t['dtype']}, {seconds:.1f} s "
          f"({t['num_tokens'] / seconds:,.0f} tokens/s)")
    if args.validation_fraction > 0:
        print(f"held out for validation in {out / 'validation'}: {t['validation_tokens']:,} tokens from "
              f"{t['validation_documents']:,} documents (fraction {args.validation_fraction:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
