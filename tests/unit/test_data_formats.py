"""The shard contract (data/formats/shard.py) held against every registered format: the same documents
written as a prepared dataset, a Megatron indexed dataset and datatrove's tokenised output (the files
laid out here byte by byte, as data/formats/megatron.py and datatrove.py document them; the real tools
write them in tests/integration/test_data_engines.py) are found by the registry, give the same tokens
and windows, pickle as their path, and an unfinished or damaged one is refused naming the fix."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from data.formats import datatrove, megatron, native
from data.formats.registry import FORMATS, find_format, is_prepared, open_shards
from data.formats.shard import num_windows, window
from data.prep.writer import prepare_token_file
from data.prepared import DataError
from data.token_source import TokenSource
from data.tokenizer import ByteTokenizer
from support.data import pydoc_texts

TEXTS = pydoc_texts()[:12]
BYTE = ByteTokenizer()


def documents(texts):
    return [np.asarray(BYTE.encode(t) + [BYTE.eos_id], dtype=np.uint16) for t in texts]


def write_megatron(prefix, docs):
    """megatron-core's IndexedDataset layout: one sequence per document, dtype code 8 (uint16)."""
    lengths = np.asarray([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 2]).astype(np.int64)
    head = megatron.MAGIC + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1)
    prefix.with_suffix(".idx").write_bytes(head + lengths.tobytes() + pointers.tobytes()
                                           + np.arange(len(docs) + 1, dtype=np.int64).tobytes())
    prefix.with_suffix(".bin").write_bytes(np.concatenate(docs).tobytes())


def write_datatrove(path, docs):
    """DocumentTokenizer's files: the ids, the documents' end offsets, then the metadata (its completion marker)."""
    path.write_bytes(np.concatenate(docs).tobytes())
    path.with_name(path.name + ".index").write_bytes(np.cumsum([len(d) for d in docs], dtype=np.uint64).tobytes())
    count = sum(len(d) for d in docs)
    path.with_name(path.name + ".metadata").write_text(f"byte|2\n{count}\n{count / 1e3:.1f}K\n")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The same 12 documents in two shards of 6, in every format (native: a .txt file is one document)."""
    root = tmp_path_factory.mktemp("formats")
    for folder in ("text", megatron.NAME, datatrove.NAME):
        (root / folder).mkdir()
    for k, texts in enumerate([TEXTS[:6], TEXTS[6:]]):
        files = [root / "text" / f"{k}-{t}.txt" for t in range(len(texts))]
        for f, text in zip(files, texts):
            f.write_text(text)
        prepare_token_file(root / native.NAME / f"{k:06d}", [str(f) for f in files])
        write_megatron(root / megatron.NAME / f"text_document_{k}", documents(texts))
        write_datatrove(root / datatrove.NAME / f"{k:05d}_unshuffled.ds", documents(texts))
    return root


def test_the_registry_finds_each_format_and_every_shard_keeps_the_contract(layouts):
    want = np.concatenate(documents(TEXTS))
    for fmt in FORMATS:
        found_format, found = find_format(layouts / fmt.NAME)
        assert found_format is fmt and len(found) == 2
        shards = open_shards(layouts / fmt.NAME, "byte")
        np.testing.assert_array_equal(np.concatenate([s.tokens for s in shards]), want, err_msg=fmt.NAME)
        for shard in shards:
            assert len(shard) == shard.meta.num_tokens == len(shard.tokens) and shard.meta.num_documents == 6
            assert (shard.meta.tokenizer, shard.meta.vocab_size, shard.meta.eos_id) == ("byte", 257, 256)
            assert len(pickle.dumps(shard)) < 2000  # its path and meta, not its tokens
            np.testing.assert_array_equal(pickle.loads(pickle.dumps(shard)).tokens, shard.tokens)
            assert [len(window(shard, w, 64)) for w in range(num_windows(shard, 64))] == [65] * num_windows(shard, 64)
    prefix = layouts / megatron.NAME / "text_document_1"  # a Megatron prefix is a data.path of its own
    assert find_format(prefix) == (megatron, [prefix])
    assert not is_prepared(layouts / "text") and not is_prepared(layouts / "nowhere")


def test_every_format_gives_the_same_windows(layouts):
    ours = TokenSource(layouts / native.NAME, 64, "byte")
    for name in (megatron.NAME, datatrove.NAME):
        theirs = TokenSource(layouts / name, 64, "byte")
        assert theirs.num_sequences == ours.num_sequences
        ids = np.arange(ours.num_sequences)
        np.testing.assert_array_equal(theirs.read(ids), ours.read(ids))


def test_nothing_found_names_every_format_and_the_prepare_command(tmp_path):
    with pytest.raises(DataError) as err:
        open_shards(tmp_path, "byte")
    assert all(fmt.WHAT in str(err.value) for fmt in FORMATS)
    assert f"python scripts/prepare_data.py --out {tmp_path} --sources pydoc --tokenizer byte" in str(err.value)


def test_unfinished_and_damaged_shards_are_refused(layouts, tmp_path):
    docs = documents(TEXTS[:3])
    (tmp_path / "dt").mkdir()
    write_datatrove(tmp_path / "dt" / "00000.ds", docs)
    (tmp_path / "dt" / "00000.ds.metadata").unlink()  # the task has not finished
    with pytest.raises(DataError, match="has no 00000.ds.metadata: datatrove writes it when the file is complete"):
        open_shards(tmp_path / "dt", "byte")
    (tmp_path / "mg").mkdir()
    write_megatron(tmp_path / "mg" / "doc", docs)
    with (tmp_path / "mg" / "doc.bin").open("r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"doc.bin is 100 bytes but .*doc.idx ends its last sequence at byte \d+: "
                                        "the pair is truncated or mismatched"):
        open_shards(tmp_path / "mg", "byte")
    (tmp_path / "mg" / "doc.idx").write_bytes(b"not an index")
    with pytest.raises(DataError, match=r"doc.idx is not a Megatron index"):
        open_shards(tmp_path / "mg", "byte")
    with pytest.raises(DataError, match="datatrove token files, which do not record their tokenizer"):
        open_shards(layouts / datatrove.NAME, None)
