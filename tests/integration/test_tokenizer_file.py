"""data.tokenizer=hf:/path/to/tokenizer.json: a published tokenizer from a local file (the test
builds and saves its own, with an end-of-document token named by a tokenizer_config.json beside
it, as Llama 3's folder does). scripts/prepare_data.py encodes with it and records its identity in
meta.json; training refuses data made with another tokenizer and a model vocabulary that is too
small; a run trains on it and its export carries the tokenizer to transformers' AutoTokenizer.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from data.batching import make_batch_plan
from data.formats.native import TokenFile, load_tokenizer, read_meta
from data.prep.writer import prepare_token_file
from data.prepared import DataError
from data.setup import build_data_pipeline
from data.tokenizer import FileTokenizer, sha256_of
from rehearsal.runs import debug_overrides
from support.data import CPU_WORLD, data_config
from support.launch import ROOT, run, run_train

EOS = "</doc>"
BOS = "<doc>"  # id 2


def save_tokenizer(folder, vocab_size: int = 300, eos: str = EOS, config: bool = True, bos: bool = False):
    """A byte-level BPE trained on a few pydoc topics, saved as FOLDER/tokenizer.json. ``bos``: with
    Llama 3's kind of post-processor (byte-level, then a template that puts BOS in front of every text)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", eos, BOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:40]], trainer=trainer)
    if bos:
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                          special_tokens=[(BOS, tok.token_to_id(BOS))])])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": BOS,
                                                                  "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    path = save_tokenizer(root / "published")
    out = root / "data"
    proc = run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--out", str(out), "--sources", "pydoc",
                "--tokenizer", f"hf:{path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokenizer hf (vocab 300)" in proc.stdout
    return root, path, out


def test_prepare_records_the_tokenizers_identity_and_its_ids(prepared):
    _, path, out = prepared
    meta = read_meta(out)
    tok = FileTokenizer.from_file(path)
    assert tok.eos_id == 1 and tok.eos_text == EOS  # from tokenizer_config.json
    assert (meta.tokenizer, meta.vocab_size, meta.eos_id) == ("hf", 300, 1)
    assert meta.tokenizer_identity == {"kind": "hf", "vocab_size": 300, "eos_id": 1, "sha256": sha256_of(path),
                                       "file": str(path.resolve())}
    assert (out / "tokenizer.json").read_bytes() == path.read_bytes()
    tokens = np.asarray(TokenFile(out).tokens)
    first = tokens[:int(np.argmax(tokens == 1))].tolist()
    from pydoc_data.topics import topics
    assert first == tok.encode(topics[sorted(topics)[0]])
    assert load_tokenizer(out).decode(first) == topics[sorted(topics)[0]]


def pipeline(data_cfg, vocab: int = 320):
    return build_data_pipeline(data_cfg, 32, 1234, make_batch_plan(8, 4, 1), 0, CPU_WORLD, model_vocab_size=vocab)


def test_training_refuses_another_tokenizer_and_a_small_vocabulary(prepared, pydoc_data, tmp_path):
    root, path, out = prepared
    pipeline(data_config(out, tokenizer=f"hf:{path}")).close()  # the right file: accepted
    with pytest.raises(DataError, match=f"data.tokenizer=byte but {out} was prepared with the hf tokenizer "
                                        r"\(vocab 300\): set data.tokenizer"):
        pipeline(data_config(out, tokenizer="byte"))
    other = save_tokenizer(root / "other", vocab_size=280)
    with pytest.raises(DataError, match=r"is not the tokenizer .* was prepared with \(sha256 "):
        pipeline(data_config(out, tokenizer=f"hf:{other}"))
    with pytest.raises(DataError, match="but .* was prepared with the byte tokenizer"):
        pipeline(data_config(pydoc_data, tokenizer=f"hf:{path}"))
    with pytest.raises(DataError, match="vocab size 300, larger than model.vocab_size=256; raise model.vocab_size "
                                        "to at least 300"):
        pipeline(data_config(out, tokenizer=f"hf:{path}"), vocab=256)


def test_a_tokenizer_without_a_known_end_of_document_token_is_named(tmp_path):
    path = save_tokenizer(tmp_path / "t", eos="<my_end>", config=False)
    with pytest.raises(ValueError, match="cannot tell its end-of-document token"):
        prepare_token_file(tmp_path / "out", ["pydoc"], f"hf:{path}")
    with pytest.raises(ValueError, match="no such file"):
        prepare_token_file(tmp_path / "out", ["pydoc"], f"hf:{tmp_path / 'missing.json'}")
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_a_run_trains_on_it_and_its_export_carries_the_tokenizer(prepared, tmp_path):
    from transformers import AutoTokenizer

    _, path, out = prepared
    run_dir = tmp_path / "run"
    run_train(debug_overrides(run_dir, out, steps=4, extra={"data.tokenizer": f"hf:{path}", "data.validation": "none",
                                                             "checkpoint.interval": 4}))
    proc = run([sys.executable, str(ROOT / "scripts" / "export.py"), str(run_dir / "checkpoints" / "step_00000004"),
                str(tmp_path / "hf"), "--format", "hf"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == path.read_bytes()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == 1  # the tokenizer's ids
    assert config["bos_token_id"] == generation["bos_token_id"] == 2
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Checkpoints are committed atomically."
    assert hf_tok(text)["input_ids"] == FileTokenizer.from_file(path).encode(text)
    assert hf_tok.eos_token == EOS
