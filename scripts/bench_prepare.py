"""Throughput of the sharded preparation (scripts/prepare_data.py --workers N) next to the tokenizer's
own speed in one process, on the same documents, measured in one run.

  python scripts/bench_prepare.py --workers 1 2 --mb 8

The corpus is the standard library's .py files (real text, offline), written as 8 .jsonl files
(8 shards); the tokenizer a byte-level BPE of --vocab ids trained on the pydoc topics and saved as a
tokenizer.json (``hf:FILE``), so no run trains one. "tokenizer alone" encodes every document with
the same FileTokenizer in this process and writes nothing: the ceiling of one process. Each
preparation writes a fresh folder (tokens fsynced and hashed, as a real one does).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from data.prep.bpe import train_bpe
from data.prep.shards import prepare_shards
from data.prep.sources import stdlib_documents
from data.tokenizer import FileTokenizer


def write_corpus(folder: Path, megabytes: float, files: int = 8) -> list:
    docs, size = [], 0
    for text in stdlib_documents():
        docs.append(text)
        size += len(text.encode())
        if size >= megabytes * 1e6:
            break
    folder.mkdir(parents=True)
    for k in range(files):
        (folder / f"part{k:02d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[k::files]))
    return docs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--mb", type=float, default=8.0, help="megabytes of text")
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_prepare-"))
    try:
        from pydoc_data.topics import topics

        (root / "tok").mkdir()
        train_bpe([topics[k] for k in sorted(topics)], args.vocab).save(root / "tok")
        spec = f"hf:{root / 'tok' / 'tokenizer.json'}"
        docs = write_corpus(root / "corpus", args.mb)
        tok = FileTokenizer.from_file(root / "tok" / "tokenizer.json")
        start = time.perf_counter()
        n = sum(len(tok.encode(t)) + 1 for t in docs)
        alone = n / (time.perf_counter() - start)
        print(f"{sum(len(t.encode()) for t in docs) / 1e6:.1f} MB of text, {len(docs)} documents, {n:,} tokens "
              f"(BPE, vocab {args.vocab}), {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        print(f"tokenizer alone, 1 process: {alone:,.0f} tokens/s")
        for workers in args.workers:
            out = root / f"out{workers}"
            start = time.perf_counter()
            totals = prepare_shards(out, [str(root / "corpus")], spec, workers=workers, shard_bytes=1,
                                    log=lambda _: None)
            seconds = time.perf_counter() - start
            assert totals["num_tokens"] == n, (totals["num_tokens"], n)
            print(f"prepare_data --workers {workers}: {n / seconds:,.0f} tokens/s ({seconds:.2f} s, "
                  f"{totals['shards']} shards; {n / seconds / alone:.2f}x the tokenizer alone)")
            shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
