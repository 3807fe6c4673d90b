"""The shape from the folder (``model=hf model.init_from=PATH``) and the published Llama 3.1 / 3.2 presets.

The published config.json values are written here (no download): each preset must be exactly
that shape (hf_shape_problems empty, the rotary scaling and max positions equal, the published
parameter count), ``model=hf`` must fill every model key from such a config.json (the same
ModelConfig as the preset), a model.* given on the command line that disagrees stops with the
key named, and scripts/plan.py and train.py's dry run plan the folder's model.
"""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from configs.keys import ConfigError
from model.counting import count_params
from model.hf import hf_shape_problems
from support.launch import ROOT, load_script, run_train
from trainer.config import register
from trainer.preflight import validate_config

ROPE_8 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
          "rope_type": "llama3"}
ROPE_32 = {**ROPE_8, "factor": 32.0}
COMMON = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
          "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "initializer_range": 0.02,
          "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "pretraining_tp": 1,
          "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "use_cache": True,
          "vocab_size": 128256}
# meta-llama/Llama-3.1-8B, Llama-3.1-70B (and Llama-3.3-70B-Instruct), Llama-3.2-1B, Llama-3.2-3B config.json
PUBLISHED = {
    "llama3_1_8b": ({**COMMON, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                     "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_scaling": ROPE_8,
                     "tie_word_embeddings": False}, 8_030_261_248),
    "llama3_1_70b": ({**COMMON, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                      "num_hidden_layers": 80, "num_key_value_heads": 8, "rope_scaling": ROPE_8,
                      "tie_word_embeddings": False}, 70_553_706_496),
    "llama3_2_1b": ({**COMMON, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                     "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64, "rope_scaling": ROPE_32,
                     "tie_word_embeddings": True}, 1_235_814_400),
    "llama3_2_3b": ({**COMMON, "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24,
                     "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128, "rope_scaling": ROPE_32,
                     "tie_word_embeddings": True}, 3_212_749_824),
}


def compose_cfg(*overrides):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def config_only_folder(path, config):
    """A Hugging Face folder's small files: config.json and an (empty) weight index, enough to plan."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    return path


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_is_the_published_shape(preset):
    published, params = PUBLISHED[preset]
    cfg = OmegaConf.to_object(compose_cfg(f"model={preset}").model)
    assert hf_shape_problems(cfg, published, preset) == []
    assert cfg.rope_scaling == published["rope_scaling"]
    assert cfg.max_seq_len == published["max_position_embeddings"]
    assert count_params(cfg).total == params


@pytest.mark.parametrize("preset", ["llama3_1_8b", "llama3_2_1b"])
def test_model_hf_fills_every_key_from_config_json(preset, tmp_path):
    folder = config_only_folder(tmp_path / preset, PUBLISHED[preset][0])
    cfg = compose_cfg("model=hf", f"model.init_from={folder}", "dry_run=true")
    validate_config(cfg, None, files=True)
    filled = vars(OmegaConf.to_object(cfg.model))
    expected = vars(OmegaConf.to_object(compose_cfg(f"model={preset}").model))
    differ = {k for k in expected if filled[k] != expected[k]}
    assert differ == {"name", "init_from"}, differ


def test_model_overrides_that_disagree_with_the_folder_are_named(tmp_path):
    folder = config_only_folder(tmp_path / "l31", PUBLISHED["llama3_1_8b"][0])
    cfg = compose_cfg("model=hf", f"model.init_from={folder}", "model.n_layers=3", "model.intermediate_size=640",
                      "model.max_seq_len=4096", "dry_run=true")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, None, files=True)
    assert f"model.n_layers=3 but {folder} has num_hidden_layers=32" in str(err.value)
    assert f"model.intermediate_size=640 but {folder} has intermediate_size=14336" in str(err.value)
    assert "max_seq_len" not in str(err.value)  # positions are the run's choice, not the weights'
    # A preset without intermediate_size: the message says which key sets the width.
    cfg = compose_cfg("model=8b", f"model.init_from={folder}", "dry_run=true")
    problems = hf_shape_problems(OmegaConf.to_object(cfg.model), PUBLISHED["llama3_1_8b"][0], "F")
    assert problems == ["model.rope_scaling=None but F has rope_scaling={'rope_type': 'llama3', 'factor': 8.0, "
                        "'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192.0}"]
    cfg = compose_cfg("model=8b", "model.ffn_dim_multiplier=null")
    problems = hf_shape_problems(OmegaConf.to_object(cfg.model), PUBLISHED["llama3_1_8b"][0], "F")
    assert "the FFN width (set model.intermediate_size, or model.dim, model.multiple_of, model.ffn_dim_multiplier)" \
        "=11264 but F has intermediate_size=14336" in problems
    with pytest.raises(ConfigError, match="model=hf takes the shape from the weights it starts from; add "
                                          "model.init_from=PATH"):
        validate_config(compose_cfg("model=hf"), 1)


def test_plan_script_plans_the_folders_shape(tmp_path, capsys):
    """scripts/plan.py model=hf model.init_from=FOLDER (its main in this process): the plan of the preset
    with the folder's shape, number for number."""
    folder = config_only_folder(tmp_path / "l32", PUBLISHED["llama3_2_1b"][0])
    layout = ["parallel.dp_shard=4", "parallel.tp=2", "training.seq_len=8192", "training.global_batch_size=8",
              "training.micro_batch_size=1", "--json"]
    plans = {}
    for name, model in (("folder", ["model=hf", f"model.init_from={folder}"]), ("preset", ["model=llama3_2_1b"])):
        assert load_script("plan").main([*model, *layout]) == 0
        plans[name] = json.loads(capsys.readouterr().out)
    assert plans["folder"]["params_total"] == PUBLISHED["llama3_2_1b"][1]
    assert plans["folder"].pop("model") == "hf" and plans["preset"].pop("model") == "llama3_2_1b"
    assert plans["folder"] == plans["preset"]


@pytest.mark.distributed
def test_dry_run_plans_the_folders_model(tmp_path):
    folder = config_only_folder(tmp_path / "l32", PUBLISHED["llama3_2_1b"][0])
    proc = run_train(["model=hf", f"model.init_from={folder}", "dry_run=true", "parallel.dp_shard=4", "parallel.tp=2",
                      "training.seq_len=8192", "training.global_batch_size=8", "training.micro_batch_size=1",
                      f"output_root={tmp_path}"])
    assert "model hf: 1,235,814,400 parameters (1.24 B)" in proc.stdout
    assert "original_max_position_embeddings: 8192" in proc.stdout and "max_seq_len: 131072" in proc.stdout
    assert "dp_shard" in proc.stdout.split("model hf:")[1]  # the per-rank plan follows
