"""An HF folder to a checkpoint (scripts/convert_checkpoint.py HF DST --to raw|dcp) and back, exactly.

A transformers-built Llama 3.1-style model (llama3 rotary scaling, GQA, tied embeddings, bf16),
saved in 4 shards with model.safetensors.index.json (as published 8B and 70B folders are) and with a
generation_config.json holding sampling defaults, is converted: the result is a committed checkpoint
that verifies, its tensors are the folder's upcast to fp32 bit for bit (q/k rows in Meta's order),
stock DCP reads the dcp one, ``model.init_from`` starts from it at another layout (tp 2, shape from
it with ``model=hf``) with HF's logits, and an HF export of it gives the folder's tensors bit for bit,
its config.json with only the fields the project owns (hf_config.OWNED_FIELDS: the dtype) differing
and its generation_config.json unchanged. A training run started from the folder with ``model=hf``
and a lowered model.max_seq_len exports the same config.json back (max_position_embeddings too) and
the same generation_config.json: the fields that came in go out unchanged.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from test_interop_import import export_hf, folder_tensors, hf_random_model, import_with
from test_llama3_rope import SCALED, SCALING

from checkpoint.durable.manifest import verify_checkpoint
from checkpoint.interop.export import load_tensors
from checkpoint.interop.hf_config import GENERATION_IDS, OWNED_FIELDS
from metrics.records import read_metrics
from model.config import ModelConfig
from model.hf import from_hf_rows, hf_name, rotary_heads
from rehearsal.runs import debug_overrides
from support.launch import ROOT, run, run_train, subprocess_env, torchrun, worker

TIED = ModelConfig(**{**vars(SCALED), "tie_embeddings": True})


def convert(src, dst, fmt):
    proc = run([sys.executable, str(ROOT / "scripts" / "convert_checkpoint.py"), str(src), str(dst), "--to", fmt])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def config_diff(a: dict, b: dict) -> set:
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def assert_generation_config_back(src, out) -> None:
    """The folder's generation_config.json came back unchanged (the ids it lacks added from config.json)."""
    before = json.loads((src / "generation_config.json").read_text())
    after = json.loads((out / "generation_config.json").read_text())
    assert {k: after.get(k) for k in before} == before, (before, after)
    assert set(after) - set(before) <= set(GENERATION_IDS), (before, after)
    assert (after["temperature"], after["top_p"], after["eos_token_id"]) == (0.6, 0.9, [2, 3, 9])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-convert") / "llama"
    # 200 kB shards: 4 files and an index for 0.8 MB of bf16 weights
    hf_random_model(out, TIED, dtype=torch.bfloat16, seed=5, max_shard_size="200KB", rope_scaling=dict(SCALING),
                    bos_token_id=1, eos_token_id=[2, 3], pretraining_tp=1)
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 3
    from transformers import GenerationConfig, LlamaForCausalLM

    # A publisher's sampling defaults, and one more end-of-text id than config.json lists (as instruct models do)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 3, 9], do_sample=True, temperature=0.6,
                     top_p=0.9).save_pretrained(out)
    # Read back in fp32 (a model cast to bf16 and back keeps bf16 rotary frequencies: not the reference)
    return out, LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.distributed
def test_converted_folder_is_bitwise_loads_at_tp2_and_exports_back(folder, tmp_path):
    src, model = folder
    said = convert(src, tmp_path / "raw", "raw")
    assert f"start from it with model.init_from={tmp_path / 'raw'}" in said
    manifest = verify_checkpoint(tmp_path / "raw")  # every file's size and checksum
    assert (manifest.step, manifest.components, manifest.init_from["kind"]) == (0, ["model"], "hf")
    original = folder_tensors(src)  # every shard's
    saved = load_tensors(tmp_path / "raw")
    assert torch.equal(saved["output.weight"], saved["tok_embeddings.weight"])  # tied: saved under both names
    for name, t in saved.items():
        heads = rotary_heads(name, TIED)
        theirs = original[hf_name(name, TIED)].float()  # tied: output.weight is HF's embed_tokens
        assert t.dtype == torch.float32 and torch.equal(t, from_hf_rows(theirs, heads) if heads else theirs), name
    # stock DCP reads the dcp conversion into the same tensors
    convert(src, tmp_path / "dcp", "dcp")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    stock = torch.load(tmp_path / "dcp.pt")["model"]
    assert stock.keys() == saved.keys() and all(torch.equal(stock[n], t) for n, t in saved.items())
    # model.init_from=DST at tp 2, the shape from the checkpoint: HF's logits
    got = import_with(tmp_path / "out.pt", tmp_path / "dcp", "tp2", "model=hf", "seq=96")
    tokens = torch.randint(0, TIED.vocab_size, (2, 96), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(tokens).logits
    assert ((got["logits_by_len"][96] - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    # and back: the folder's tensors bit for bit, its config.json with only the owned fields rewritten
    export_hf(tmp_path / "raw", tmp_path / "again", "--dtype", "bf16")
    again = folder_tensors(tmp_path / "again")
    assert again.keys() == original.keys() and all(torch.equal(again[n], t) for n, t in original.items())
    before = json.loads((src / "config.json").read_text())
    after = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config_diff(before, after) <= set(OWNED_FIELDS), config_diff(before, after)
    assert (after["bos_token_id"], after["eos_token_id"], after["pretraining_tp"]) == (1, [2, 3], 1)
    assert_generation_config_back(src, tmp_path / "again")


@pytest.mark.distributed
def test_runs_from_the_folder_and_from_its_conversion_start_alike_and_export_config_json_back(folder, pydoc_data,
                                                                                              tmp_path):
    """model=hf with model.init_from=FOLDER (model.max_seq_len lowered to 64 from the folder's 128), and with
    checkpoint.resume=CONVERTED (weights only: it starts the run like model.init_from): the same first
    loss, bit for bit (the rotary tables' rows do not depend on max_seq_len); the exports give config.json
    back, max_position_embeddings too, and generation_config.json. Both runs at 2 ranks, rank 1 unable to
    read any manifest.json, config.json or .metadata (tests/support/workers/rank_read_errors.py): rank 0 reads them
    and decides for both (the weights-only switch, the shape, the source and its hash), so both ranks take
    the same path, and rank 1 never tries to read them."""
    src, _ = folder
    convert(src, tmp_path / "converted", "raw")
    losses = {}
    unreadable = {"READ_ERROR_RANK": "1", "READ_ERROR_NAMES": "manifest.json,config.json,.metadata"}
    for name, source in (("folder", {"model.init_from": str(src), "model.max_seq_len": 64}),
                         ("converted", {"checkpoint.resume": str(tmp_path / "converted")})):
        extra = {"model": "hf", **source, "checkpoint.interval": 1, "optim.warmup_steps": 0}
        proc = run(torchrun(2, worker("rank_read_errors"), *debug_overrides(tmp_path / name, pydoc_data, steps=1,
                                                                          extra=extra)),
                   env=subprocess_env(unreadable), timeout=300)
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert "resume: fresh start" in proc.stderr and "weights from model.init_from=" in proc.stderr
        assert "rank_read_errors: rank 1 refused 0 reads" in proc.stderr, proc.stderr[-3000:]
        losses[name] = read_metrics(tmp_path / name)[0]["loss"]
    assert losses["folder"] == losses["converted"], losses
    # A restart takes the shape from its own checkpoint: the folder may be gone by then.
    extra = {"model": "hf", "model.init_from": str(tmp_path / "gone"), "checkpoint.interval": 1,
             "optim.warmup_steps": 0}
    proc = run_train(debug_overrides(tmp_path / "folder", pydoc_data, steps=2, extra=extra))
    assert "model.init_from ignored (resumed: the checkpoint's weights win)" in proc.stderr
    for name in losses:
        ckpt = tmp_path / name / "checkpoints" / "step_00000001"
        trained_at = json.loads((ckpt / "manifest.json").read_text())["config"]["model"]["max_seq_len"]
        assert trained_at == {"folder": 64, "converted": 128}[name]
        export_hf(ckpt, tmp_path / f"{name}-hf")
        before = json.loads((src / "config.json").read_text())
        after = json.loads((tmp_path / f"{name}-hf" / "config.json").read_text())
        assert config_diff(before, after) <= set(OWNED_FIELDS), (name, config_diff(before, after))
        assert after["max_position_embeddings"] == 128
        assert_generation_config_back(src, tmp_path / f"{name}-hf")
