"""scripts/prepare_data.py: real text in, a verifiable memory-mapped token file out."""

import json
import sys

import numpy as np
import pytest

from data.token_file import TokenFile, prepare_token_file, read_meta, sha256_file
from data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from support.launch import ROOT, run


def test_default_corpus_round_trips_through_the_byte_tokenizer(pydoc_data):
    meta = read_meta(pydoc_data)
    assert (meta.tokenizer, meta.vocab_size, meta.eos_id, meta.dtype) == ("byte", 257, 256, "uint16")
    assert meta.num_tokens > 400_000 and meta.num_documents > 50
    assert meta.sha256 == sha256_file(pydoc_data / "tokens.bin")
    tokens = np.asarray(TokenFile(pydoc_data).tokens)
    assert (tokens == 256).sum() == meta.num_documents  # one EOS after every document
    first_doc = tokens[: int(np.argmax(tokens == 256))]
    from pydoc_data.topics import topics
    assert ByteTokenizer().decode(first_doc) == topics[sorted(topics)[0]]


def test_user_files_and_bpe(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    with (tmp_path / "corpus" / "b.jsonl").open("w") as f:
        for i in range(30):
            f.write(json.dumps({"text": f"Record {i}: checkpoints are committed atomically."}) + "\n")
    out = tmp_path / "bpe"
    meta = prepare_token_file(out, [str(tmp_path / "corpus")], "bpe", bpe_vocab_size=300)
    assert meta.tokenizer == "bpe" and meta.num_documents == 31 and meta.vocab_size <= 300
    tok = load_tokenizer(out)
    assert isinstance(tok, BPETokenizer)
    text = "Record 7: checkpoints are committed atomically."
    assert tok.decode(tok.encode(text)) == text
    assert meta.num_tokens < 40 * 45 + 31 * 48  # BPE compresses below one token per byte


def test_jsonl_without_text_field_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match='bad.jsonl:1: a .jsonl record needs a "text" field'):
        prepare_token_file(tmp_path / "out", [str(bad)])


def test_truncated_token_file_is_detected(tmp_path):
    out = tmp_path / "ds"
    prepare_token_file(out, ["pydoc"])
    with (out / "tokens.bin").open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(ValueError, match="truncated or stale"):
        read_meta(out)


def test_script_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "ds"
    cmd = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--out", str(out)]
    first = run(cmd)
    assert first.returncode == 0 and "tokens from" in first.stdout
    again = run(cmd)
    assert again.returncode == 1 and "--force" in again.stderr
    forced = run(cmd + ["--force"])
    assert forced.returncode == 0
