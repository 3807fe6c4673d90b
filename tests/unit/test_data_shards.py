"""New sources (parquet, .jsonl.gz, .jsonl.zst, folders of them) and the sharded preparation
(scripts/prepare_data.py --workers N, data/prep/shards.py): the same shards for any N, equal to the
single-process preparation token for token, the validation split, and a relaunch after a worker's
real SIGKILL that redoes only the unfinished shards."""

from __future__ import annotations

import gzip
import json
import os
import signal
import sys
import time

import numpy as np
import pytest

from data.formats.native import PLAN_FILE, TokenFile
from data.prep.shards import STALL_ENV, prepare_shards
from data.prep.sources import iter_documents
from data.prep.writer import prepare_token_file
from data.prepared import DataError
from data.token_source import TokenSource
from support.data import pydoc_texts
from support.launch import ROOT, run
from support.processes import alive, start

SHARD_BYTES = 1  # a shard per file: the corpus below makes 6


def write_corpus(root):
    """The pydoc topics in every source format, in a folder whose sorted order is the topics' order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts, folder = pydoc_texts(), root / "corpus"
    (folder / "f").mkdir(parents=True)
    lines = lambda docs: "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs))  # noqa: E731
    (folder / "a.jsonl").write_text(lines(texts[:15]))
    with gzip.open(folder / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines(texts[15:30]))
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(texts[30:45]).encode()))
    pq.write_table(pa.table({"id": list(range(20)), "text": texts[45:65]}), folder / "d.parquet", row_group_size=6)
    (folder / "e.txt").write_text(texts[65])
    pq.write_table(pa.table({"text": texts[66:]}), folder / "f" / "g.parquet", row_group_size=4)
    (folder / "notes.md").write_text("not a source: skipped")
    return folder, texts


def shard_files(out):
    """{relative path: bytes} of every file a preparation wrote (the plan and the tokenizer included)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_every_format_yields_its_documents_in_order(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, texts = corpus
    assert list(iter_documents([str(folder)])) == texts
    pq.write_table(pa.table({"content": texts[:3]}), tmp_path / "x.parquet")
    assert list(iter_documents([str(tmp_path / "x.parquet")], text_column="content")) == texts[:3]
    with pytest.raises(ValueError, match=r"x.parquet: no column 'text' \(columns: \['content'\]\).*--text-column"):
        list(iter_documents([str(tmp_path / "x.parquet")]))
    with pytest.raises(ValueError, match=r'a.jsonl:1: a .jsonl record needs a "body" field.*--text-column'):
        list(iter_documents([str(folder / "a.jsonl")], text_column="body"))



def test_documents_without_text_are_dropped_and_whitespace_only_ones_kept(tmp_path):
    """One rule in every source format and both preparations (datatrove's readers apply it too:
    tests/integration/test_data_engines.py): a document with no text ("" or null, an empty .txt) is dropped, a
    whitespace-only one or one of special tokens only is text, kept. No document is its EOS alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.tokenizer import ByteTokenizer

    folder, eos = tmp_path / "corpus", ByteTokenizer.eos_id
    folder.mkdir()
    records = ["A first document.", "", "   ", "\n\t\n", None, "<|endoftext|>", "", "The last one."]
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
    pq.write_table(pa.table({"text": ["", None, " ", "row"]}), folder / "b.parquet")
    (folder / "c.txt").write_text("")
    kept = [t for t in records if t] + [" ", "row"]
    assert list(iter_documents([str(folder)])) == kept
    want = [i for t in kept for i in ByteTokenizer().encode(t) + [eos]]
    single = prepare_token_file(tmp_path / "single", [str(folder)])
    sharded = prepare_shards(tmp_path / "sharded", [str(folder)], workers=1, shard_bytes=SHARD_BYTES,
                             log=lambda _: None)
    assert single.num_documents == sharded["num_documents"] == len(kept) == 7
    assert list(TokenFile(tmp_path / "single").tokens) == want
    assert list(np.concatenate([s.tokens for s in TokenSource(tmp_path / "sharded", 8).shards])) == want
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    with pytest.raises(ValueError, match=r"yielded no documents for training \(documents without text are dropped\)"):
        prepare_token_file(tmp_path / "none", [str(tmp_path / "empty.jsonl")])
    (tmp_path / "numbers.jsonl").write_text('{"text": "fine"}\n{"text": 7}\n')
    with pytest.raises(ValueError, match=r'numbers.jsonl:2: the "text" field is int 7, not text; name the text'):
        prepare_token_file(tmp_path / "numbers", [str(tmp_path / "numbers.jsonl")])
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints.parquet: column 'text' holds int64, not text; name the text column"):
        prepare_token_file(tmp_path / "ints", [str(tmp_path / "ints.parquet")])

def test_shards_are_the_same_for_1_and_2_workers_and_equal_the_single_file(corpus, tmp_path):
    folder, texts = corpus
    one, two, single = tmp_path / "w1", tmp_path / "w2", tmp_path / "single"
    totals = prepare_shards(one, [str(folder)], validation_fraction=0.1, workers=1, shard_bytes=SHARD_BYTES,
                            log=lambda _: None)
    prepare_shards(two, [str(folder)], validation_fraction=0.1, workers=2, shard_bytes=SHARD_BYTES, log=lambda _: None)
    assert totals["shards"] == 6 and totals["validation_documents"] == 7
    assert shard_files(one) == shard_files(two)  # byte for byte: tokens, meta.json, plan

    meta = prepare_token_file(single, [str(folder)], validation_fraction=0.1)
    for part, want in (("", single), ("validation", single / "validation")):
        got = np.concatenate([TokenFile(p).tokens for p in sorted((two / part).glob("0*"))])
        np.testing.assert_array_equal(got, TokenFile(want).tokens)  # same documents, same order, same ids
    assert (totals["num_tokens"], totals["num_documents"]) == (meta.num_tokens, meta.num_documents)
    source = TokenSource(two, seq_len=64)  # what data.path reads
    assert len(source.shards) == 6 and source.num_tokens == meta.num_tokens
    assert TokenSource(two / "validation", seq_len=64).num_tokens == meta.validation["num_tokens"]


def test_a_changed_request_and_an_unfinished_folder_are_refused(corpus, tmp_path):
    folder, _ = corpus
    out = tmp_path / "ds"
    prepare_shards(out, [str(folder)], shard_bytes=SHARD_BYTES, log=lambda _: None)
    with pytest.raises(DataError, match=r"shard_bytes: 1 -> 1000.*--force"):
        prepare_shards(out, [str(folder)], shard_bytes=1000, log=lambda _: None)
    os.rename(out / "000003", out / ".gone")
    with pytest.raises(DataError, match=r"preparation of .*ds is unfinished: 1 planned shard\(s\).*\(000003\)"):
        TokenSource(out, seq_len=64)


def test_a_relaunch_after_a_worker_is_killed_redoes_only_the_unfinished_shards(corpus, tmp_path):
    folder, _ = corpus
    out, want = tmp_path / "ds", tmp_path / "uninterrupted"
    prepare_shards(want, [str(folder)], validation_fraction=0.1, shard_bytes=SHARD_BYTES, log=lambda _: None)
    cmd = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--sources", str(folder), "--out", str(out),
           "--workers", "2", "--shard-bytes", str(SHARD_BYTES), "--validation-fraction", "0.1"]
    log = (tmp_path / "log").open("w")
    job = start(cmd, log, extra_env={STALL_ENV: "000003"})  # the worker of shard 3 stops after a document
    try:
        deadline = time.monotonic() + 60
        while not (stalled := list(out.glob(".tmp-000003-*"))) or len(list(out.glob("00000[0-5]"))) < 5:
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)
        worker = int(stalled[0].name.rsplit("-", 1)[1])
        assert worker != job.pid and alive(worker)
        os.kill(worker, signal.SIGKILL)
        assert job.wait(timeout=60) == 1
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    assert "a worker preparing" in (tmp_path / "log").read_text()
    assert (out / PLAN_FILE).is_file() and not (out / "000003").exists()
    done = {p.name: p.stat().st_ino for p in out.glob("0*")}  # complete before the kill
    with pytest.raises(DataError, match="unfinished"):
        TokenSource(out, seq_len=64)

    again = run(cmd, warm=False)  # the same command, no stall (cold: it imports no torch)
    assert again.returncode == 0, again.stderr
    assert f"{len(done)} already complete" in again.stdout
    assert {n: (out / n).stat().st_ino for n in done} == done  # not redone
    assert not list(out.rglob(".tmp-*"))
    assert shard_files(out) == shard_files(want)
