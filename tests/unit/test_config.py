"""Config composition: every experiment composes, typos and wrong types fail, bad values are named."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from configs.keys import ConfigError
from model.counting import count_params
from trainer.config import register
from trainer.preflight import validate_config

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))
register()


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_experiment_files_are_global_packages():
    assert {"debug", "70b"} <= set(EXPERIMENTS)
    for name in EXPERIMENTS:
        first = (ROOT / "configs" / "experiment" / f"{name}.yaml").read_text().splitlines()[0]
        assert first == "# @package _global_", name


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name):
    cfg = compose_cfg(f"+experiment={name}")
    validate_config(cfg)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert cfg.run_dir == f"{cfg.output_root}/{cfg.run_name}"


def test_presets_have_llama3_sizes():
    cfg70 = compose_cfg("+experiment=70b")
    assert count_params(OmegaConf.to_object(cfg70.model)).total == 70_553_706_496
    m = cfg70.model
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.vocab_size, m.rope_theta) == (
        80, 8192, 64, 8, 128256, 500000.0)
    assert OmegaConf.to_object(cfg70.model).ffn_hidden_dim == 28672
    assert cfg70.training.mixed_precision == "bf16" and cfg70.parallel.tp == 8
    assert cfg70.checkpoint.async_mode == "async" and cfg70.optim.schedule == "cosine"
    assert count_params(OmegaConf.to_object(compose_cfg("model=8b").model)).total == 8_030_261_248


@pytest.mark.parametrize("override", ["training.stepz=3", "model.dimm=64", "+experiment=nope"])
def test_unknown_keys_fail_at_compose_time(override):
    with pytest.raises(ConfigCompositionException):
        compose_cfg(override)


def test_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="steps"):
        compose_cfg("training.steps=many")


@pytest.mark.parametrize("overrides, message", [
    (["model.n_heads=5"], "model.n_heads=5 does not divide model.dim=128"),
    (["model.n_kv_heads=3"], "model.n_kv_heads=3 does not divide model.n_heads=4"),
    (["optim.warmup_steps=500"], "optim.warmup_steps=500 is longer than the run \\(training.steps=300\\)"),
    (["training.seq_len=4096"], "training.seq_len=4096 is above the model's maximum model.max_seq_len=512"),
    (["data.tokenizer=sentencepiece"], "unknown tokenizer 'sentencepiece'"),
    (["training.mixed_precision=fp8"], "training.mixed_precision='fp8'"),
    (["checkpoint.load_threads=0"], "checkpoint.load_threads=0 must be in \\[1, 256\\]"),
])
def test_bad_values_are_named(overrides, message):
    cfg = compose_cfg("+experiment=debug", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_all_problems_are_reported_together():
    cfg = compose_cfg("+experiment=debug", "model.n_heads=5", "optim.warmup_steps=500")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "n_heads=5" in str(err.value) and "warmup_steps=500" in str(err.value)
