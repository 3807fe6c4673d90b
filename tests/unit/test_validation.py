"""The held-out validation split and the evaluator, without training processes: which documents
are held out (never in the training tokens), what the config checks say, and the evaluator's
fixed batches and side-effect-free evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from configs.keys import ConfigError
from data.batching import make_batch_plan
from data.config import DataConfig
from data.formats.native import TokenFile, read_meta
from data.prep.split import held_out
from data.prep.writer import prepare_token_file, sha256_file
from data.token_source import TokenSource
from data.tokenizer import ByteTokenizer
from data.validation import open_validation
from model.config import ModelConfig
from model.llama import build_model
from trainer.config import register
from trainer.preflight import validate_config
from training.evaluate import Evaluator

ROOT = Path(__file__).resolve().parents[2]
register()


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def documents(path) -> list:
    """The texts of a prepared byte-level dataset, split at EOS."""
    tokens = np.asarray(TokenFile(path).tokens)
    ends = np.flatnonzero(tokens == ByteTokenizer.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ByteTokenizer().decode(tokens[a:b]) for a, b in zip(starts, ends)]


def test_held_out_documents_never_reach_the_training_tokens(pydoc_data):
    """pydoc_data is prepared as the debug experiment prepares it (10% held out)."""
    from pydoc_data.topics import topics

    train, val = documents(pydoc_data), documents(pydoc_data / "validation")
    corpus = [topics[k] for k in sorted(topics)]
    assert sorted(train + val) == sorted(corpus)  # every document, once, on one side
    assert not set(train) & set(val)
    assert val == [t for t in corpus if held_out(t, 0.1)] and 3 <= len(val) <= 15
    meta, vmeta = read_meta(pydoc_data), read_meta(pydoc_data / "validation")
    block = meta.validation
    assert (block["fraction"], block["path"], block["num_documents"]) == (0.1, "validation", len(val))
    assert block["num_tokens"] == vmeta.num_tokens == sum(len(t.encode()) + 1 for t in val)
    assert block["sha256"] == vmeta.sha256 == sha256_file(pydoc_data / "validation" / "tokens.bin")
    assert meta.num_documents == len(train) and vmeta.validation is None


def test_without_a_fraction_the_dataset_is_as_before(tmp_path):
    """No split: meta.json has no validation block, so datasets prepared before splits existed read the same."""
    meta = prepare_token_file(tmp_path / "plain", ["pydoc"], "byte")
    assert meta.validation is None and not (tmp_path / "plain" / "validation").exists()
    assert "validation" not in json.loads((tmp_path / "plain" / "meta.json").read_text())
    assert meta.num_documents == 79


def test_the_bpe_tokenizer_is_trained_on_the_training_documents_only(tmp_path):
    docs = [f"Document {i}: " + " ".join(f"word{i * j % 97}" for j in range(60)) for i in range(40)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare_token_file(tmp_path / "split", [str(corpus)], "bpe", bpe_vocab_size=300, validation_fraction=0.25)
    kept = tmp_path / "kept.jsonl"
    kept.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs if not held_out(d, 0.25)))
    prepare_token_file(tmp_path / "train_only", [str(kept)], "bpe", bpe_vocab_size=300)
    trained = (tmp_path / "train_only" / "tokenizer.json").read_text()
    assert (tmp_path / "split" / "tokenizer.json").read_text() == trained
    assert (tmp_path / "split" / "validation" / "tokenizer.json").read_text() == trained
    assert (tmp_path / "split" / "tokens.bin").read_bytes() == (tmp_path / "train_only" / "tokens.bin").read_bytes()


def test_a_fraction_that_holds_out_nothing_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("one small document")
    with pytest.raises(ValueError, match=r"validation fraction 0.001 held out none of the 1 documents"):
        prepare_token_file(tmp_path / "out", [str(tmp_path / "a.txt")], "byte", validation_fraction=0.001)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        prepare_token_file(tmp_path / "out", [str(tmp_path / "a.txt")], "byte", validation_fraction=1.0)


@pytest.mark.parametrize("overrides, message", [
    (["data.validation_fraction=1.5"], r"data.validation_fraction=1.5 must be in \[0, 1\)"),
    (["data.validation_fraction=0"], r"data.validation=held_out with data.prepare_if_missing=true needs "
                                     r"data.validation_fraction > 0"),
    (["eval.batches=0"], "eval.batches=0 must be >= 1"),
    (["data.validation=none", "checkpoint.keep_best=2", "checkpoint.best_metric=val_loss"],
     r"checkpoint.best_metric=val_loss ranks checkpoints by their validation loss, but this run does not evaluate "
     r"\(data.validation=none, eval.interval=50\)"),
    (["logging.peak_tflops=0"], "logging.peak_tflops=0.0 must be > 0"),
])
def test_bad_eval_settings_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_cfg("+experiment=debug", *overrides))


def test_missing_validation_data_says_how_to_prepare_it(tmp_path, pydoc_data):
    plain = tmp_path / "pydoc-byte"
    prepare_token_file(plain, ["pydoc"], "byte")
    cfg = compose_cfg("+experiment=debug", f"data.path={plain}")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=1, files=True)
    assert (f"data.validation=held_out, but {plain} was prepared without a held-out split "
            f"(no {plain}/validation/meta.json); prepare it again with one: python scripts/prepare_data.py --out "
            f"{plain} --sources pydoc --tokenizer byte --validation-fraction 0.1 --force") in str(err.value)
    cfg = compose_cfg("+experiment=debug", f"data.path={pydoc_data}", f"data.validation={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match=f"no prepared dataset at data.validation={tmp_path / 'nowhere'}"):
        validate_config(cfg, world_size=1, files=True)
    validate_config(compose_cfg("+experiment=debug", f"data.path={pydoc_data}"), world_size=1, files=True)
    # a separate path is fine when it shares the tokenizer; a held-out split of a mixture is not defined
    validate_config(compose_cfg("+experiment=debug", f"data.path={pydoc_data}",
                                f"data.validation={pydoc_data / 'validation'}"), world_size=1, files=True)
    cfg = compose_cfg("+experiment=debug", f"+data.mixture=[{{path: {pydoc_data}, weight: 1.0}}]")
    with pytest.raises(ConfigError, match="data.validation=held_out names the split held out of data.path, but "
                                          "this run trains on data.mixture"):
        validate_config(cfg, world_size=1, files=True)


def test_a_validation_set_with_another_tokenizer_is_refused(tmp_path, pydoc_data):
    (tmp_path / "c.txt").write_text("The validation text. " * 200)
    prepare_token_file(tmp_path / "bpe", [str(tmp_path / "c.txt")], "bpe", bpe_vocab_size=300)
    cfg = OmegaConf.structured(DataConfig(path=str(pydoc_data), validation=str(tmp_path / "bpe")))
    with pytest.raises(ValueError, match=r"uses tokenizer \(name, vocab, eos\) \('bpe'"):
        open_validation(cfg, 64, TokenSource(pydoc_data, 64))


def _evaluator(pydoc_data, dp=1, rank=0, batches=4, global_batch=8, micro=2, seq_len=64, model=None):
    cfg = OmegaConf.structured(DataConfig(path=str(pydoc_data), validation="held_out"))
    source = open_validation(cfg, seq_len, TokenSource(pydoc_data, seq_len))
    model = model or build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=320), seed=1)
    return Evaluator(model, source, make_batch_plan(global_batch, micro, dp), rank, batches=batches, interval=10,
                     total_steps=25, eos_id=256, device=torch.device("cpu"))


def test_evaluation_reads_fixed_batches_and_leaves_no_trace(pydoc_data):
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=320, dropout=0.2), seed=1).train()
    ev = _evaluator(pydoc_data, model=model)
    # The same windows for every dp size: the ranks' slices of each batch make up the whole batch.
    ids = ev.sequence_ids()
    assert len(ids) == 32 and len(set(ids.tolist())) == 32
    sliced = [_evaluator(pydoc_data, dp=2, rank=r) for r in (0, 1)]
    read = sorted(i for e in sliced for r in e.micro_batches for i in range(r.start, r.start + r.count))
    assert read == list(range(32)) and np.array_equal(sliced[0].sequence_ids(), ids)
    rng = torch.get_rng_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first, second = ev.evaluate(), ev.evaluate()
    assert first.loss == second.loss and first.tokens == second.tokens == 32 * 64  # deterministic, dropout off
    assert torch.equal(torch.get_rng_state(), rng), "evaluation drew random numbers"
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert 5.0 < first.loss < 6.5  # an untrained model: about ln(320) = 5.77
    # due: every interval, after the last step, before a save
    assert [s for s in range(1, 26) if ev.due(s)] == [10, 20, 25] and ev.due(7, saving=True)


def test_more_validation_batches_than_the_set_holds_are_refused(pydoc_data):
    windows = TokenSource(pydoc_data / "validation", 64).num_sequences
    with pytest.raises(ValueError, match=rf"eval.batches=200 x training.global_batch_size=8 = 1600 validation "
                                         rf"sequences, but the validation set .* holds {windows} sequences of "
                                         rf"seq_len 64 \+ 1 .*lower eval.batches to at most {windows // 8}"):
        _evaluator(pydoc_data, batches=200)


def test_keep_best_ranks_by_validation_loss(tmp_path):
    from checkpoint.durable.discovery import apply_retention, checkpoint_id, list_committed
    from checkpoint.durable.manifest import FileEntry, Manifest, write_manifest

    for step, loss, val in ((10, 3.0, 2.0), (20, 2.0, 1.5), (30, 1.0, 1.8), (40, 0.9, None)):
        d = tmp_path / checkpoint_id(step)
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x")
        write_manifest(d, Manifest(checkpoint_id(step), step, 0, 0, 0.0, "h", {}, 1, {}, 8, loss, None, None,
                                   {"__0_0.distcp": FileEntry(1, None)}, val_loss=val))
    apply_retention(tmp_path, keep_last=1, keep_every=0, keep_best=1, best_metric="val_loss")
    assert [c.step for c in list_committed(tmp_path)] == [40, 20]  # newest, and the lowest val_loss (not loss)
