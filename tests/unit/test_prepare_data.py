"""scripts/prepare_data.py: real text in, a verifiable memory-mapped token file out; data.prepare_if_missing
runs it in a process of its own."""

import json
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from data.formats.native import TokenFile, load_tokenizer, read_meta
from data.prep.writer import prepare_token_file, sha256_file
from data.prepared import DataError
from data.setup import prepare_if_missing
from data.tokenizer import BPETokenizer, ByteTokenizer
from rehearsal.runs import DEBUG_EXPERIMENT
from support.data import CPU_WORLD, data_config
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


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_prepare_if_missing_writes_what_the_preparation_writes(pydoc_data, tmp_path):
    """The run prepares data.path by running scripts/prepare_data.py: byte for byte the debug experiment's
    dataset as the preparation writes it in its own process (the session's pydoc_data), split included."""
    debug = OmegaConf.load(DEBUG_EXPERIMENT).data
    path = tmp_path / "pydoc-byte"
    cfg = data_config(path, prepare_if_missing=True, sources=list(debug.sources), tokenizer=debug.tokenizer,
                      validation_fraction=debug.validation_fraction)
    prepare_if_missing(cfg, CPU_WORLD)
    assert _files(path) == _files(pydoc_data) and "validation/tokens.bin" in _files(path)


def test_a_failed_preparation_names_the_command_its_exit_code_and_its_stderr(tmp_path):
    missing, path = tmp_path / "corpus.jsonl", tmp_path / "corpus-byte"
    with pytest.raises(DataError) as err:
        prepare_if_missing(data_config(path, prepare_if_missing=True, sources=[str(missing)]), CPU_WORLD)
    message = str(err.value)
    assert (f"could not prepare {path}: `python scripts/prepare_data.py --out {path} --sources {missing} --tokenizer "
            "byte` exited with code 1; the end of its stderr:") in message
    assert f"FileNotFoundError: data source '{missing}' is neither a built-in corpus" in message.splitlines()[-1]
    assert err.value.agreed and not path.exists()  # every rank raises it (train.py prints it once)
