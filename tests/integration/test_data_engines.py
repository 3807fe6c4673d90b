"""Data prepared by other engines trains here in place: datatrove's tokenised output (written by
scripts/prepare_datatrove.py: datatrove's LocalPipelineExecutor, 2 tasks on 2 processes) and
Megatron's indexed datasets (written by megatron-core's own IndexedDatasetBuilder). Both hold the
same token ids as this project's preparation of the same documents with the same tokenizer (one
whose post-processor puts BOS in front of every document, as Llama 3's does), give the same global
batches at dp=1 and dp=2 and after a resume, and train to the same losses."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from test_tokenizer_file import save_tokenizer

from data.formats.native import TokenFile
from data.prep.writer import prepare_token_file
from data.token_source import TokenSource
from metrics.records import read_metrics
from rehearsal.runs import debug_overrides
from support.data import assert_same_batches, data_config, global_batches, pipeline, pydoc_texts
from support.launch import ROOT, load_script, run, run_train

pytestmark = pytest.mark.distributed
TASKS = 2


def megatron_builder():
    """megatron-core's writer (its package __init__ imports the model-parallel stack: ~10 s of CPU)."""
    import warnings

    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": nothing here needs them
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    return IndexedDatasetBuilder


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("engines")
    texts, files = pydoc_texts(), []
    (root / "in").mkdir()
    for k in range(4):
        files.append(root / "in" / f"part{k}.jsonl")
        files[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[k * 20:(k + 1) * 20]))
    tok = save_tokenizer(root / "tok", bos=True)  # ids: BOS, the text, EOS
    spec = f"hf:{tok}"
    ours = root / "ours"  # this project's preparation, one shard per datatrove task (task k: files k, k+2)
    for k in range(TASKS):
        prepare_token_file(ours / f"{k:06d}", [str(f) for f in files[k::TASKS]], spec)
    proc = run([sys.executable, str(ROOT / "scripts" / "prepare_datatrove.py"), "--input", str(root / "in"),
                "--tokenizer", str(tok), "--out", str(root / "datatrove"), "--tasks", str(TASKS), "--workers", "2"],
               warm=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    builder_cls, eos = megatron_builder(), TokenFile(ours / "000000").meta.eos_id
    (root / "megatron").mkdir()
    for k in range(TASKS):
        prefix = root / "megatron" / f"text_document_{k}"
        builder = builder_cls(f"{prefix}.bin", dtype=np.uint16)
        ids = np.asarray(TokenFile(ours / f"{k:06d}").tokens)
        for doc in np.split(ids, np.flatnonzero(ids == eos)[:-1] + 1):  # a document, ended by its EOD
            builder.add_item(torch.from_numpy(doc.astype(np.int64)))
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
    return root, spec


@pytest.mark.parametrize("bos", [False, True])
def test_the_datatrove_post_processor_gives_this_projects_ids(tmp_path, bos):
    """What prepare_datatrove.py gives datatrove's tokenizer in place of its own EOS-only post-processor:
    the tokenizer's own (BOS here when it has one), then EOS, as prepare_data.py encodes a document."""
    from test_tokenizer_file import BOS
    from tokenizers import Tokenizer

    from data.tokenizer import FileTokenizer

    path = save_tokenizer(tmp_path, bos=bos)
    ours = FileTokenizer.from_file(path)
    theirs = Tokenizer.from_file(str(path))
    theirs.post_processor = load_script("prepare_datatrove").own_then_eos(path, ours.eos_text)
    for text in pydoc_texts()[:5]:
        want = ours.encode(text) + [ours.eos_id]
        assert theirs.encode(text).ids == want
        assert (want[0] == ours._tok.token_to_id(BOS)) == bos



# Records at the edges: no text ("" and null: dropped by both preparations), whitespace only (kept by both),
# special tokens only (text: kept; the hf tokenizer's own specials encode to their ids), the byte tokenizer's
# end-of-text literal inside a document (its bytes with the byte tokenizer).
EDGE_RECORDS = ["A first document.", "", "   ", "\n\t\n", "<|endoftext|>", "</doc>", "<doc></doc>", None,
                "x <|endoftext|> y", "", "The last document."]


@pytest.mark.parametrize("tokenizer", ["hf", "byte"])
def test_both_preparations_keep_and_drop_the_same_documents(tmp_path, tokenizer):
    """scripts/prepare_datatrove.py (datatrove's reader and DocumentTokenizer) and prepare_data.py on the same
    records: the same documents (8 of 11: the two empty ones and the null dropped), the same ids, with a
    tokenizer.json whose post-processor puts BOS in front (hf) and with --tokenizer byte (the byte tokenizer's
    tokenizer.json twin: the literal <|endoftext|> stays 13 bytes, as prepare_data.py's byte tokenizer has it)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "edges.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in EDGE_RECORDS))
    if tokenizer == "hf":
        path = save_tokenizer(tmp_path / "tok", bos=True)
        spec, arg = f"hf:{path}", str(path)
    else:
        spec = arg = "byte"
    prepare_token_file(tmp_path / "ours", [str(tmp_path / "in" / "edges.jsonl")], spec)
    proc = run([sys.executable, str(ROOT / "scripts" / "prepare_datatrove.py"), "--input", str(tmp_path / "in"),
                "--tokenizer", arg, "--out", str(tmp_path / "datatrove")], warm=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [ours], [theirs] = (TokenSource(tmp_path / name, 8, spec).shards for name in ("ours", "datatrove"))
    assert ours.meta.num_documents == theirs.meta.num_documents == 8
    np.testing.assert_array_equal(theirs.tokens, ours.tokens)
    if tokenizer == "byte":
        assert int((np.asarray(ours.tokens) == 256).sum()) == 8  # one EOS per document: none from the literal
        assert list(ours.tokens[:18]) == list(b"A first document.") + [256]

def test_token_ids_equal_this_projects_preparation(engines):
    root, spec = engines
    ours = TokenSource(root / "ours", 64, spec)
    for kind in ("datatrove", "megatron"):
        theirs = TokenSource(root / kind, 64, spec)
        assert len(theirs.shards) == len(ours.shards) == TASKS
        for a, b in zip(theirs.shards, ours.shards):
            np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"{kind} shard {a.path}")
            assert a.meta.num_documents == b.meta.num_documents
            assert a.tokens[0] == 2  # BOS (<doc>): every document starts with it
        assert theirs.tokenizer == ours.tokenizer == ("hf", 300, 1)
    assert (root / "datatrove-logs" / "completions").is_dir()  # datatrove's own per-task markers
    assert len(list((root / "datatrove-logs" / "completions").iterdir())) == TASKS


def test_the_order_is_the_same_at_every_dp_and_after_a_resume(engines):
    root, spec = engines
    want = global_batches(data_config(root / "ours", tokenizer=spec), dp=1, steps=6)
    for kind in ("datatrove", "megatron"):
        cfg = data_config(root / kind, tokenizer=spec)
        assert_same_batches(global_batches(cfg, dp=2, steps=6), want)
        pipe = pipeline(cfg, dp=2, rank=0)
        for step in range(3):
            pipe.next_micro_batches(step)
        state = pipe.state_dict()
        pipe.close()
        assert_same_batches(global_batches(cfg, dp=4, steps=3, state=state), want[3:])


def test_a_source_without_its_tokenizer_is_refused(engines):
    from data.prepared import DataError

    root, _ = engines
    with pytest.raises(DataError, match="megatron token files, which do not record their tokenizer; set "
                                        "data.tokenizer"):
        TokenSource(root / "megatron", 64, "bpe")


def test_they_train_to_the_same_losses(engines, tmp_path):
    root, spec = engines
    losses = {}
    for kind in ("ours", "datatrove", "megatron"):
        run_train(debug_overrides(tmp_path / kind, root / kind, steps=3,
                                  extra={"data.tokenizer": spec, "data.validation": "none"}))
        losses[kind] = [r["loss"] for r in read_metrics(tmp_path / kind) if r.get("kind", "step") == "step"]
    assert len(losses["ours"]) == 3 and losses["ours"][0] > 3.0
    assert losses["datatrove"] == losses["ours"] == losses["megatron"]
