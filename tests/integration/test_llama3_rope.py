"""Llama 3.1+ rotary scaling (rope_type llama3, model/rope.py), proven with transformers itself.

- The inverse frequencies of the published Llama 3.1 8B config (its config.json values written
  here, no download) are bitwise the ones transformers computes, and a few are pinned as numbers.
- A random LlamaForCausalLM with llama3 rope scaling, saved by save_pretrained in shards (with
  model.safetensors.index.json, as published 8B and 70B folders are), imported with ``model=hf``
  (no model.* override) at 1 process and tp 2: its logits equal HF's within 1e-5 x max |logit| at a
  sequence length below original_max_position_embeddings and one above it.
- The rotary tables' rows do not depend on model.max_seq_len (so an export keeps the folder's
  max_position_embeddings when a run trains at fewer positions).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_interop_import import hf_random_model, import_with

from model.config import ModelConfig
from model.rope import inv_frequencies, rope_tables

# meta-llama/Llama-3.1-8B config.json (the fields that decide the rotary embedding)
LLAMA31_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
              "max_position_embeddings": 131072,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
# A small model whose 16 frequencies fall in all three bands of original = 32 positions (wavelength
# below 32 / 4 kept, above 32 / 1 divided by 4, between interpolated).
SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}
SCALED = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, multiple_of=32, norm_eps=1e-5,
                     rope_theta=10000.0, max_seq_len=128, rope_scaling=SCALING)
BELOW, ABOVE = 24, 128  # sequence lengths below and above original_max_position_embeddings


def test_llama31_8b_inverse_frequencies_are_transformers_bitwise():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(**{**LLAMA31_8B, "rope_scaling": dict(LLAMA31_8B["rope_scaling"])})
    hf_inv, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = inv_frequencies(128, 500000.0, LLAMA31_8B["rope_scaling"])
    assert attention_factor == 1.0  # llama3 scaling leaves the cos/sin tables unscaled
    assert torch.equal(ours, hf_inv.float())
    pinned = {0: 1.0, 10: 0.12868738174438477, 20: 0.016560440883040428, 30: 0.0013718936825171113,
              40: 3.428102354519069e-05, 50: 4.411534519022098e-06, 63: 3.068925877869333e-07}
    assert {j: ours[j].item() for j in pinned} == pinned
    plain = inv_frequencies(128, 500000.0)
    assert torch.equal(ours[:20], plain[:20])  # short wavelengths kept
    assert torch.equal(ours[50:], plain[50:] / 8)  # long ones divided by the factor


def test_small_model_covers_all_three_bands():
    plain, scaled = inv_frequencies(SCALED.head_dim, 10000.0), inv_frequencies(SCALED.head_dim, 10000.0, SCALING)
    kept, divided = scaled == plain, scaled == plain / 4
    assert kept.any() and divided.any() and (~kept & ~divided).any(), (plain, scaled)


def test_rotary_tables_do_not_depend_on_max_seq_len():
    """Row p is cos/sin(p x the inverse frequencies), which take no max_seq_len: a run at fewer positions
    computes the published model's rotary embedding at each of them."""
    short, full = rope_tables(SCALED.head_dim, 64, 10000.0, scaling=SCALING), \
        rope_tables(SCALED.head_dim, 128, 10000.0, scaling=SCALING)
    assert torch.equal(short[0], full[0][:64]) and torch.equal(short[1], full[1][:64])


def test_bad_rope_scaling_is_named():
    with pytest.raises(ValueError, match="rope_type='yarn'; model/rope.py implements 'llama3'"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0}).validate()
    with pytest.raises(ValueError, match=r"needs numbers for \['high_freq_factor'\]"):
        ModelConfig(rope_scaling={k: v for k, v in SCALING.items() if k != "high_freq_factor"}).validate()


@pytest.fixture(scope="module")
def scaled_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-llama3-rope") / "llama"
    # transformers adds to rope_scaling; 400 kB shards: 5 files and an index for 1.8 MB of weights
    model = hf_random_model(out, SCALED, seed=3, max_shard_size="400KB", rope_scaling=dict(SCALING))
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 3
    return out, model


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["1", "tp2"])
def test_llama3_rope_logits_equal_transformers_without_model_overrides(layout, scaled_folder, tmp_path):
    folder, model = scaled_folder
    got = import_with(tmp_path / "out.pt", folder, layout, "model=hf", f"seq={BELOW},{ABOVE}")
    assert got["shape"]["rope_scaling"] == SCALING and got["shape"]["max_seq_len"] == 128
    for n in (BELOW, ABOVE):
        tokens = torch.randint(0, SCALED.vocab_size, (2, n), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            ref = model(tokens).logits
        rel = ((got["logits_by_len"][n] - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-5, (layout, n, rel)
        assert torch.equal(got["logits_by_len"][n].argmax(-1), ref.argmax(-1))
