"""Config composition: every experiment composes, typos and wrong types fail, bad values are named."""

import re
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


FT = ["parallel.fault_tolerance.enabled=true", "parallel.fault_tolerance.lighthouse=http://127.0.0.1:29510"]


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.fault_tolerance.enabled=true"], None, "needs parallel.fault_tolerance.lighthouse"),
    (FT + ["parallel.fault_tolerance.min_replicas=3"], None,
     "min_replicas=3 is above parallel.fault_tolerance.groups=2: no step could ever commit"),
    (FT + ["parallel.fault_tolerance.replica_id=2"], None,
     "replica_id=2 is not below parallel.fault_tolerance.groups=2"),
    (FT + ["parallel.dp_replicate=2"], 2, "parallel.dp_replicate=2: each replica group is its own torchrun job"),
    (FT + ["parallel.fault_tolerance.quorum_timeout_s=200"], None,
     "recovery.timeouts.data_wait=120 s is not above parallel.fault_tolerance.quorum_timeout_s \\+ timeout_s"),
    # the debug batch (16 = micro 8 x 2 ranks) cannot split over 3 groups of 1 rank: a quorum of 3 would stop
    (FT + ["parallel.fault_tolerance.groups=3"], 1, "with 3 replica groups of 1 data-parallel ranks"),
    (FT, None, "checkpoint.dir=.*/checkpoints is inside this replica group's run_dir=.*: the groups share one "
               "checkpoint.dir"),
])
def test_bad_fault_tolerance_values_are_named(overrides, world, message):
    cfg = compose_cfg("+experiment=debug", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, world)


def test_all_problems_are_reported_together():
    cfg = compose_cfg("+experiment=debug", "model.n_heads=5", "optim.warmup_steps=500")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "n_heads=5" in str(err.value) and "warmup_steps=500" in str(err.value)


GPUS_PER_NODE = 8  # the 70b recipe's nodes: tp 8 inside each


def test_the_70b_recipe_names_the_world_sizes_it_runs_at():
    """Its global batch of 512 sequences in micro-batches of 1 splits over 64 data-parallel ranks (64 nodes
    at tp 8), 32 or 16, not over 61 to 63: the launcher's check of --nnodes 61:64 (world sizes 488 to 512,
    checked here as numbers, no process started) and each rank's start-up check at a group re-formed with
    61, 62 or 63 nodes must say which world sizes work and what to launch."""
    cfg = compose_cfg("+experiment=70b")
    [warning] = validate_config(cfg, tuple(n * GPUS_PER_NODE for n in range(61, 65)))
    assert "world sizes [488, 496, 504] of the elastic range 488 to 512 cannot run this layout" in warning
    assert "the range's world sizes that work: [512]; launch with --nnodes 64 (min = max)" in warning, warning
    for nodes in (61, 62, 63):
        with pytest.raises(ConfigError) as err:
            validate_config(cfg, nodes * GPUS_PER_NODE)
        assert (f"world size {nodes * GPUS_PER_NODE} cannot run this layout; the nearest that can: 256 and 512 "
                "ranks") in str(err.value), str(err.value)
        assert "--nnodes" in str(err.value)
    assert validate_config(cfg, 64 * GPUS_PER_NODE) == []


def _advertised_70b_launches():
    """Every ``NNODES=... [NPROC=...] ... +experiment=70b`` line of the launchers' and the docs' examples."""
    for path in ("scripts/launch_multi_node.sh", "scripts/rendezvous_store.py", "docs/parallelism.md",
                 "docs/recovery-runbook.md", "README.md"):
        text = (ROOT / path).read_text().replace("\\\n#", " ")
        for line in text.splitlines():
            nnodes = re.search(r"\bNNODES=(\d+)(?::(\d+))?", line)
            if nnodes and "+experiment=70b" in line:
                nproc = re.search(r"\bNPROC=(\d+)", line)
                yield path, int(nnodes[1]), int(nnodes[2] or nnodes[1]), int(nproc[1]) if nproc else 8


def test_the_launchers_advertise_only_node_counts_the_70b_recipe_runs_at():
    launches = list(_advertised_70b_launches())
    assert any(path == "scripts/launch_multi_node.sh" for path, *_ in launches)
    cfg = compose_cfg("+experiment=70b")
    for path, low, high, nproc in launches:
        assert validate_config(cfg, tuple(n * nproc for n in range(low, high + 1))) == [], (path, low, high)
