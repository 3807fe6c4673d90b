"""scripts/export.py --format hf, proven with transformers itself: the folder loads with
``LlamaForCausalLM.from_pretrained`` (no missing, unexpected or resized tensors, no code from this
project) and gives the project's logits, for grouped-query attention, multi-head attention and
tied embeddings, Llama 3.1's rotary scaling, from a single-process checkpoint with optimizer state and from a train.py
checkpoint saved at dp_shard=2; the tokenizer files let AutoTokenizer encode the data's ids and
``generate`` continue a prompt as the project's model does.

Tolerance: logits |diff| <= 1e-4 x max |logit| (fp32; measured <= 3e-7) and the same argmax at
every position.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from checkpoint.durable.discovery import committed_dir
from checkpoint.durable.manifest import Manifest
from checkpoint.durable.saver import CheckpointSaver
from checkpoint.interop.export import export_hf, load_tensors
from checkpoint.state.training_state import TrainingState
from data.tokenizer import ByteTokenizer
from model.config import ModelConfig
from model.llama import build_model
from rehearsal.runs import debug_overrides
from support.launch import ROOT, run, run_train

SHAPES = {
    "gqa": ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=32),
    "mha": ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=32, rope_theta=500000.0),
    "tied": ModelConfig(name="t", dim=64, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=96, max_seq_len=32,
                        tie_embeddings=True, norm_eps=1e-6, multiple_of=48),
    # Llama 3.1's rotary scaling (31 positions, past the original 8) and an FFN width set directly
    "llama3": ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=32,
                          intermediate_size=80, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
}


def trained_checkpoint(root, cfg: ModelConfig):
    """Two AdamW steps (norms move too), saved with the project's saver: model, optimizer, schedule."""
    model = build_model(cfg, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    state = TrainingState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    state.step = 2
    CheckpointSaver(root, "sync", 0, 1).save(state.state_dict(), Manifest(
        "step_00000002", 2, 0, 0, 0.0, "h", {"model": vars(cfg)}, 1, {}, 2, None, None, None))
    return committed_dir(root, 2), model.eval()


def assert_loads_and_matches(folder, model, vocab: int, seq: int = 31):
    from transformers import LlamaForCausalLM

    hf, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), hf.eval()(tokens).logits
    rel = ((theirs - ours).abs().max() / ours.abs().max()).item()
    assert rel <= 1e-4, rel
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))
    return hf


@pytest.mark.parametrize("shape", list(SHAPES))
def test_export_loads_in_transformers_with_the_same_logits(shape, tmp_path):
    cfg = SHAPES[shape]
    ckpt, model = trained_checkpoint(tmp_path / "ckpt", cfg)
    info = export_hf(ckpt, tmp_path / "hf", max_shard_size=60_000)  # several shards and an index
    assert info["shards"] > 1
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == info["shards"]
    assert ("lm_head.weight" in index["weight_map"]) == (not cfg.tie_embeddings)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: config[k] for k in ("num_key_value_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                                   "intermediate_size", "max_position_embeddings", "torch_dtype")} == {
        "num_key_value_heads": cfg.kv_heads, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "intermediate_size": cfg.ffn_hidden_dim,
        "max_position_embeddings": cfg.max_seq_len, "torch_dtype": "float32"}
    assert (tmp_path / "hf" / "generation_config.json").is_file()
    assert_loads_and_matches(tmp_path / "hf", model, cfg.vocab_size)


def test_export_refuses_a_non_empty_folder_and_keeps_it(tmp_path):
    ckpt, _ = trained_checkpoint(tmp_path / "ckpt", SHAPES["gqa"])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        export_hf(ckpt, tmp_path / "hf")
    assert (tmp_path / "hf" / "mine.txt").read_text() == "keep me"



def test_the_byte_models_exported_tokenizer_is_the_byte_tokenizer_in_transformers(pydoc_data, tmp_path):
    """AutoTokenizer on the export of a byte model gives the byte tokenizer's ids for every string, a document
    holding the literal <|endoftext|> too (its 13 bytes: transformers registers the eos_token as special, which
    split_special_tokens in tokenizer_config.json keeps out of the text), and decodes them back."""
    import random

    from transformers import AutoTokenizer

    from data.tokenizer import EOS_TEXT
    from support.text import random_text

    ckpt, _ = trained_checkpoint(tmp_path / "ckpt", SHAPES["gqa"])
    info = export_hf(ckpt, tmp_path / "hf", tokenizer=pydoc_data)
    assert info["tokenizer"].startswith("byte tokenizer from")
    tok, ours, rng = AutoTokenizer.from_pretrained(tmp_path / "hf"), ByteTokenizer(), random.Random(36)
    assert tok("x <|endoftext|> y")["input_ids"] == list(b"x <|endoftext|> y")
    assert (tok.eos_token, tok.eos_token_id) == (EOS_TEXT, ByteTokenizer.eos_id)
    for text in [random_text(rng) for _ in range(500)]:
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text), text
        assert tok.decode(ids + [ours.eos_id], skip_special_tokens=True) == text

@pytest.mark.distributed
def test_export_of_a_dp_shard2_training_run_generates_like_the_project(pydoc_data, tmp_path):
    from transformers import AutoTokenizer

    run_dir = tmp_path / "run"
    run_train(debug_overrides(run_dir, pydoc_data, steps=20, extra={"parallel.dp_shard": 2,
                                                                  "checkpoint.interval": 20}), nproc=2)
    ckpt = run_dir / "checkpoints" / "step_00000020"
    proc = run([sys.executable, str(ROOT / "scripts" / "export.py"), str(ckpt), str(tmp_path / "hf"),
                "--format", "hf"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokenizer: byte tokenizer from" in proc.stdout
    cfg = ModelConfig(**{k: v for k, v in json.loads((ckpt / "manifest.json").read_text())["config"]["model"].items()})
    model = build_model(cfg, seed=0)
    model.load_state_dict(load_tensors(ckpt))  # the project's model, consolidated from the two ranks' shards
    hf = assert_loads_and_matches(tmp_path / "hf", model, cfg.vocab_size, seq=64)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = "The assert statement"
    ids = tok(prompt)["input_ids"]
    assert ids == ByteTokenizer().encode(prompt)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0].tolist()
    ours = list(ids)
    with torch.no_grad():
        for _ in range(12):  # greedy decoding with the project's model, no cache
            ours.append(int(model(torch.tensor([ours]))[0, -1].argmax()))
    assert out == ours
    assert tok.decode(out[len(ids):]) == ByteTokenizer().decode(ours[len(ids):])
