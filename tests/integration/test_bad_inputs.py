"""Every bad config value gets a clear message before anything is allocated: the key, the value
and the valid choices (or the bound), all problems in one block; train.py prints that block
without a traceback and exits with code 2, a Hydra compose error (unknown key, wrong type) too.

Most values are checked in-process with validate_config (fast); a few real train.py launches
show the exit code, the single block and that nothing was written into the run directory."""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from configs.keys import ConfigError, bound_of, numeric_keys
from data.config import DataSourceConfig
from recovery.config import FaultConfig
from support.config import compose_debug as _compose
from support.launch import ROOT, load_script, run, run_train, subprocess_env, torchrun
from trainer.config import Config, register
from trainer.preflight import validate_config

register()

PHASES = "['first_step', 'step', 'data_wait', 'checkpoint_snapshot', 'checkpoint_load', 'eval', 'shutdown']"

# (override, what the message must say: the key, the value, the valid choices or the bound)
BAD = [
    ("checkpoint.interval=often", ["checkpoint.interval='often'", "a step count", "auto"]),
    ("checkpoint.interval=-5", ["checkpoint.interval=-5", ">= 0", "auto"]),
    ("checkpoint.interval=1.5", ["checkpoint.interval='1.5'", "a step count", "auto"]),
    ("checkpoint.keep_last=0", ["checkpoint.keep_last=0", ">= 1"]),
    ("checkpoint.keep_every=-1", ["checkpoint.keep_every=-1", ">= 0"]),
    ("checkpoint.keep_best=-1", ["checkpoint.keep_best=-1", ">= 0"]),
    ("checkpoint.best_metric=accuracy", ["checkpoint.best_metric='accuracy'", "['loss', 'probe_loss', 'val_loss']"]),
    ("checkpoint.async_mode=background", ["checkpoint.async_mode='background'", "['sync', 'async', 'async_process']"]),
    ("checkpoint.on_save_error=ignore", ["checkpoint.on_save_error='ignore'", "['stop', 'continue']"]),
    ("checkpoint.s3.endpoint_url=minio:9000", ["checkpoint.s3.endpoint_url='minio:9000'", "with its scheme"]),
    ("checkpoint.s3.addressing_style=sideways", ["checkpoint.s3.addressing_style='sideways'",
                                                 "['auto', 'path', 'virtual']"]),
    ("checkpoint.resume=latest", ["checkpoint.resume='latest'", "['auto', 'never', 'must']", "a step number"]),
    ("checkpoint.resume=/nonexistent/step_00000010",
     ["checkpoint.resume='/nonexistent/step_00000010'", "['auto', 'never', 'must']", "manifest.json"]),
    ("checkpoint.load_threads=0", ["checkpoint.load_threads=0", "in [1, 256]"]),
    ("checkpoint.commit_timeout_s=0", ["checkpoint.commit_timeout_s=0.0", "in (0, 100000000]"]),
    ("+recovery.timeouts.stepp=3", ["recovery.timeouts", "['stepp']", PHASES]),
    ("recovery.timeouts.step=0", ["recovery.timeouts.step=0.0", "in (0, 100000000]"]),
    ("recovery.checkpoint_write_timeout_s=0", ["recovery.checkpoint_write_timeout_s=0.0", "in (0, 100000000]"]),
    ("recovery.read_retries=6", ["recovery.read_retries=6 with recovery.read_retry_backoff_s=2", "126 s",
                                 "fails after 120 s", "lower read_retries or read_retry_backoff_s"]),
    ("recovery.faults=[{kind:explode}]", ["recovery.faults[0].kind='explode'", "'sigkill', 'hang'", "'disk_full'"]),
    ("recovery.faults=[{phase:lunch}]", ["recovery.faults[0].phase='lunch'", "'step', 'data_wait', 'gradients'"]),
    ("recovery.faults=[{kind:corrupt,phase:step}]", ["recovery.faults[0]", "corrupt", "phase=checkpoint_committed",
                                                      "(not 'step')"]),
    ("recovery.faults=[{kind:corrupt,phase:checkpoint_committed,corruption:shred}]",
     ["recovery.faults[0].corruption='shred'", "['truncate', 'flip_byte', 'delete_file', 'delete_manifest']"]),
    ("recovery.faults=[{kind:bitflip_param,bit:40}]", ["recovery.faults[0].bit=40", "[0, 32)"]),
    ("recovery.faults=[{kind:disk_full,phase:step}]", ["recovery.faults[0]", "disk_full",
                                                        "['checkpoint_write', 'checkpoint_commit', 'memory_commit', "
                                                        "'memory_replica_write']",
                                                        "(not 'step')"]),
    ("recovery.preemption_signals=[SIGFOO]", ["recovery.preemption_signals", "'SIGFOO'", "SIGTERM, SIGUSR1"]),
    ("recovery.preemption_grace_s=0", ["recovery.preemption_grace_s=0.0", "in (0, 100000000]"]),
    ("recovery.guards.action=panic", ["recovery.guards.action='panic'",
                                      "['log', 'skip_step', 'block_verified', 'rollback']"]),
    ("recovery.straggler_factor=1.0", ["recovery.straggler_factor=1.0", "> 1"]),
    ("recovery.max_fallbacks=-1", ["recovery.max_fallbacks=-1", ">= 0"]),
    ("parallel.device=tpu", ["parallel.device='tpu'", "['auto', 'cpu', 'cuda']"]),
    ("parallel.param_dtype=fp16", ["parallel.param_dtype='fp16'", "['fp32', 'bf16']"]),
    ("parallel.reduce_dtype=int8", ["parallel.reduce_dtype='int8'", "['fp32', 'bf16']"]),
    ("parallel.activation_checkpoint=some", ["parallel.activation_checkpoint='some'", "['none', 'full', 'selective']"]),
    ("parallel.collective_timeout_s=0", ["parallel.collective_timeout_s=0.0", "in (0, 100000000]"]),
    ("training.mixed_precision=fp8", ["training.mixed_precision='fp8'", "['fp32', 'bf16', 'fp16']"]),
    ("training.ema_decay=1.0", ["training.ema_decay=1.0", "[0, 1)"]),
    ("training.grad_clip=-1", ["training.grad_clip=-1.0", ">= 0"]),
    ("data.tokenizer=sentencepiece", ["data.tokenizer", "'sentencepiece'", "['byte', 'bpe']"]),
    ("optim.schedule=linear", ["optim.schedule='linear'", "['cosine', 'constant']"]),
    ("optim.name=sgd", ["optim.name='sgd'", "['adamw']"]),
    ("optim.implementation=fast", ["optim.implementation='fast'", "['auto', 'fused', 'foreach', 'for-loop']"]),
    ("optim.lr_min=1.0", ["optim.lr_min=1.0", "between 0 and optim.lr=0.003"]),
    ("logging.level=LOUD", ["logging.level='LOUD'", "['DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL']"]),
    ("logging.wandb.mode=cloud", ["logging.wandb.mode='cloud'", "['disabled', 'offline', 'online']"]),
    ("checkpoint.lease_timeout_s=0.001", ["checkpoint.lease_timeout_s=0.001", "in [10, ", "heartbeat beats every "
                                          "lease_timeout_s / 4", "use >= 10 s"]),
]


@pytest.mark.parametrize("override, needles", BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_is_named_with_its_choices(override, needles):
    cfg = _compose(override)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=1, files=True)  # as train.py calls it: the values, then the file probes
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid configuration:" and len(lines) == 2, lines  # this one problem, and only it
    for needle in needles:
        assert needle in lines[1], (needle, lines[1])


def test_the_bad_values_are_at_least_25_and_each_key_once():
    keys = [b[0].split("=")[0].lstrip("+") for b in BAD]
    assert len(BAD) >= 25
    assert {"checkpoint.interval", "checkpoint.keep_last", "checkpoint.best_metric", "recovery.faults",
            "parallel.device", "parallel.param_dtype", "parallel.reduce_dtype", "data.tokenizer",
            "checkpoint.resume"} <= set(keys)
    assert any(k.startswith("recovery.timeouts.") for k in keys)


def test_an_invalid_tokenizer_does_not_suggest_preparing_data_with_it(tmp_path):
    cfg = _compose("data.tokenizer=sentencepiece", f"data.path={tmp_path / 'missing'}", "data.prepare_if_missing=true")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=1, files=True)
    assert "--tokenizer sentencepiece" not in str(err.value)


def _train(tmp_path: Path, *overrides: str):
    run_dir = tmp_path / "run"
    proc = run([sys.executable, str(ROOT / "train.py"), "+experiment=debug", f"output_root={tmp_path}",
                "run_name=run", *overrides], timeout=120)
    return proc, run_dir


@pytest.mark.distributed
def test_train_py_prints_one_block_and_exits_2(tmp_path):
    overrides = [b[0] for b in BAD if b[0].split("=")[0] in (
        "checkpoint.interval", "checkpoint.keep_last", "recovery.faults", "parallel.device", "checkpoint.resume",
        "+recovery.timeouts.stepp")]
    overrides = list(dict.fromkeys(o.split("=")[0] for o in overrides))  # one value per key
    chosen = [next(b for b in BAD if b[0].startswith(k + "=")) for k in overrides]
    proc, run_dir = _train(tmp_path, *[c[0] for c in chosen])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.count("error: ConfigError: invalid configuration:") == 1
    block = proc.stderr[proc.stderr.index("error: ConfigError"):]
    for _, needles in chosen:
        assert all(n in block for n in needles), (needles, block)
    assert not run_dir.exists()  # refused before anything was built or written


@pytest.mark.distributed
@pytest.mark.parametrize("override, needle", [
    ("checkpoint.keep_lats=3", "Key 'keep_lats' not in 'CheckpointConfig'"),  # a typo in a key
    ("training.steps=many", "Value 'many' of type 'str' could not be converted to Integer"),
])
def test_train_py_exits_2_when_hydra_cannot_compose(tmp_path, override, needle):
    proc, run_dir = _train(tmp_path, override)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert needle in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert not run_dir.exists() or not any(run_dir.iterdir())


# ---- every number of the schema: NaN, infinities, zero, negative and huge values ----

# Each numeric key gets all of these (an int key the finite ones as ints: Hydra refuses a non-finite float there).
# The huge ones do not divide evenly: a check that searched for divisors up to them would hang.
VALUES = (math.nan, math.inf, -math.inf, 0, -1, -7, -2**40, 2**62 + 1, 10**18 + 7, 1e300)
# model.rope_scaling (a mapping of any values) holds numbers the schema cannot type: set in a llama3 scaling
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}
# String keys that take a step count or "auto"
STEPS_OR_AUTO = ("checkpoint.interval", "checkpoint.memory.interval")


def _numeric_cases():
    """(schema key, the override path it is set through, type) for every numeric key of the schema, and the
    numbers of model.rope_scaling (their type: whatever is given)."""
    for key, tp in numeric_keys(Config):
        path = key.replace("recovery.timeouts.*", "recovery.timeouts.step")
        yield key, path, tp
    for leaf in ROPE:
        if leaf != "rope_type":
            yield f"model.rope_scaling.{leaf}", f"model.rope_scaling.{leaf}", None


def _with(base, path: str, value, cfg=None):
    """A copy of ``base`` with ``path`` set to ``value`` the way Hydra would (a list key gets one item: a
    data.mixture entry of the prepared data itself, which then holds no validation split). ``cfg``: such a
    copy made before for the same ``path``, whose value is replaced (a deep copy of the config costs more
    than the checks)."""
    if cfg is not None:
        OmegaConf.update(cfg, path.replace("[].", "[0]."), value, merge=False)
        return cfg
    cfg = copy.deepcopy(base)
    if "[]." in path:
        head, leaf = path.split("[].")
        if head == "data.mixture":
            OmegaConf.select(cfg, head).append(DataSourceConfig(path=cfg.data.path))
            cfg.data.validation = "none"
        else:
            OmegaConf.select(cfg, head).append(FaultConfig())
        OmegaConf.update(cfg, f"{head}[0].{leaf}", value, merge=False)
    else:
        if path.startswith("model.rope_scaling."):
            cfg.model.rope_scaling = dict(ROPE)
        OmegaConf.update(cfg, path, value, merge=False)
    return cfg


def test_every_numeric_key_declares_its_bounds():
    missing = [k for k, _, _ in _numeric_cases() if bound_of(Config, k) is None]
    assert not missing, f"declare what these can be (a bound in the key's declaration): {missing}"
    assert len(numeric_keys(Config)) >= 70


def _refusal(cfg) -> str | None:
    """The block validate_config refuses ``cfg`` with (the values and every file probe), or None."""
    try:
        validate_config(cfg, world_size=1, files=True)
    except ConfigError as err:
        return str(err)
    return None


def test_every_numeric_key_refuses_nan_infinities_and_what_it_cannot_be(tmp_path, pydoc_data):
    """validate_config as train.py calls it (files=True, on the prepared data): every value outside a key's
    bound is refused naming the key, whatever the file probes then read; no traceback, no hang."""
    base = _compose(f"data.path={pydoc_data}", f"output_root={tmp_path}")
    assert _refusal(base) is None
    refused = 0
    for key, path, tp in _numeric_cases():
        shown, cfg = path.replace("[].", "[0]."), None
        for value in VALUES:
            if tp is not None and math.isfinite(value):
                value = tp(value)
            try:
                cfg = _with(base, path, value, cfg)  # one copy of base per key: each value replaces the last
            except ValidationError as exc:  # an int key given a non-finite float: Hydra refuses it at compose
                assert tp is int and not math.isfinite(value) and shown.split("[")[0] in str(exc), (key, value, exc)
                refused += 1
                continue
            block = _refusal(cfg)
            if block is None:
                assert math.isfinite(value) and bound_of(Config, key).holds(value), f"{shown}={value} was accepted"
                continue
            # a llama3 scaling that is wrong as a whole (low_freq_factor above high_freq_factor) names the mapping
            named = shown in block or (key.startswith("model.rope_scaling.") and "model.rope_scaling=" in block
                                       and key.rsplit(".", 1)[1] in block)
            assert named, (key, value, block)
            refused += 1
    assert refused >= 3 * len(list(_numeric_cases()))  # every key refuses at least NaN and both infinities
    assert not any(tmp_path.iterdir())  # the probes created nothing


@pytest.mark.parametrize("key", STEPS_OR_AUTO)
def test_a_step_count_or_auto_refuses_every_other_string(key):
    """checkpoint.interval and checkpoint.memory.interval hold an int or 'auto' in a string: every number
    that is not a count of steps >= 0 is refused naming the key; the counts, however large, are steps."""
    base = _compose()
    for text in ("nan", "inf", "-inf", "-1", "-7", str(-2**40), "1e3", "1.5", "0x10", "often"):
        with pytest.raises(ConfigError, match=re.escape(key)):
            validate_config(_with(base, key, text), world_size=1)
    for text in ("0", "auto", str(2**62 + 1), str(10**18 + 7)):
        validate_config(_with(base, key, text), world_size=1)


@pytest.mark.parametrize("override, needle", [
    ("+training.setps=10", "training.setps: the schema has no such key; did you mean "
                           "training.steps?"),
    ("+optim.lrr=1", "did you mean optim.lr?"),
    ("+checkpoint.keep_lats=3", "did you mean checkpoint.keep_last?"),
])
def test_a_key_added_with_plus_must_be_in_the_schema(override, needle):
    with pytest.raises(ConfigError) as err:
        validate_config(_compose(override), world_size=1)
    assert needle in str(err.value)


@pytest.mark.distributed
@pytest.mark.parametrize("overrides, needles", [
    (["optim.lr=inf", "optim.weight_decay=nan", "training.grad_clip=nan"],
     ["optim.lr=inf", "optim.weight_decay=nan", "training.grad_clip=nan"]),
    (["seed=-1", "model.multiple_of=0", "+training.setps=10"],
     ["seed=-1", "model.multiple_of=0", "did you mean training.steps?"]),
])
def test_train_py_refuses_non_finite_and_degenerate_numbers(tmp_path, overrides, needles):
    proc, run_dir = _train(tmp_path, *overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.count("error: ConfigError: invalid configuration:") == 1
    assert all(n in proc.stderr for n in needles), proc.stderr[-3000:]
    assert not run_dir.exists() or not any(run_dir.iterdir())


# ---- what is knowable before allocation: the prepared data, the folders, the device ----

@pytest.mark.parametrize("overrides, needle", [
    (["model.vocab_size=100"], "model.vocab_size=100 is smaller than the vocabulary of the data at {data} (byte "
                               "tokenizer, vocab size 257); raise model.vocab_size to at least 257"),
    (["data.tokenizer=bpe"], "data.tokenizer=bpe but {data} was prepared with the byte tokenizer"),
    (["eval.batches=2000"], "eval.batches=2000 x training.global_batch_size=16 = 32000 validation sequences, but "
                            "the validation set {data}/validation holds about 381 of seq_len 128 + 1; lower "
                            "eval.batches to at most 23"),
    (["output_root={file}"], "output_root={file}: {file} is a regular file, not a folder"),
    (["checkpoint.dir={file}/ckpt"], "checkpoint.dir={file}/ckpt: {file} is a regular file, not a folder"),
    (["checkpoint.memory.interval=5", "checkpoint.memory.root={file}"],
     "checkpoint.memory.root={file}: {file} is a regular file, not a folder"),
    (["training.seq_len=0"], "training.seq_len=0 must be >= 1"),  # the validation split's size is divided by it
])
def test_the_data_and_the_folders_are_checked_before_anything_is_built(tmp_path, pydoc_data, overrides, needle):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    fill = {"data": pydoc_data, "file": blocker}
    cfg = _compose(f"data.path={pydoc_data}", f"output_root={tmp_path / 'out'}", *[o.format(**fill) for o in overrides])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=1, files=True)
    assert needle.format(**fill) in str(err.value) and len(str(err.value).splitlines()) == 2, str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing created


class _Cuda:
    """A stand-in for torch.cuda: ``count`` devices visible."""

    def __init__(self, count: int):
        self.count = count

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count


@pytest.mark.parametrize("device, env, count, refused", [
    ("cuda", {"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "0"}, 4, True),  # --nproc-per-node=8 on a 4-GPU node
    ("auto", {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 1, True),  # auto picks CUDA: the same
    ("cuda", {"LOCAL_RANK": "3"}, 2, True),  # a rank whose device does not exist
    ("cuda", {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}, 4, False),
    ("cuda", {}, 1, False),  # plain python: one process
    ("auto", {"LOCAL_WORLD_SIZE": "8"}, 0, False),  # auto without CUDA runs on the CPU
    ("cpu", {"LOCAL_WORLD_SIZE": "8"}, 1, False),
])
def test_more_processes_than_gpus_on_a_node_is_refused_before_set_device(monkeypatch, device, env, count, refused):
    from trainer.preflight import device_problems

    for key in ("LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    found = device_problems(device, cuda=_Cuda(count))
    assert bool(found) == refused, found
    if refused:
        assert f"parallel.device={device}: " in found[0] and f"torch sees {count} CUDA device" in found[0]
        assert f"start at most {count} per node (--nproc-per-node={count}" in found[0]


def test_a_file_probe_that_fails_is_a_refusal_naming_it(tmp_path, pydoc_data, monkeypatch):
    import data.checks

    def broken(cfg):
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(data.checks, "file_problems", broken)
    cfg = _compose(f"data.path={pydoc_data}", f"output_root={tmp_path}")
    with pytest.raises(ConfigError, match="the pre-flight could not finish data.path: RuntimeError: "
                                          "the probe broke"):
        validate_config(cfg, world_size=1, files=True)
    with pytest.raises(ConfigError) as err:  # with a value out of bounds the bound is the message, not the probe
        validate_config(_compose(f"data.path={pydoc_data}", f"output_root={tmp_path}", "training.seq_len=0"),
                        world_size=1, files=True)
    assert str(err.value) == "invalid configuration:\n  - training.seq_len=0 must be >= 1"


@pytest.mark.parametrize("overrides, world, needle", [
    # out of bounds: the bound alone, and no search for divisors of the value
    (["model.dim=99999999999"], 1, "model.dim=99999999999 must be in [1, 2147483647]"),
    ([f"training.global_batch_size={2**62 + 1}"], 2, f"training.global_batch_size={2**62 + 1} must be in [1, "),
    ([f"model.vocab_size={2**62 + 1}", "parallel.tp=2"], 2, f"model.vocab_size={2**62 + 1} must be in [1, "),
    # in bounds, and the suggestions are divisors of a value near 2**31: found by arithmetic, not a scan up to it
    (["model.n_heads=1073741823", "model.dim=2147483646", "model.n_kv_heads=2"], 1,
     "model.n_kv_heads=2 does not divide model.n_heads=1073741823; valid n_kv_heads: [1, 3, 7, 9, 11, 21, "),
    (["training.global_batch_size=2147483647"], 2, "dp sizes that do: [1, 2147483647]"),
    (["model.vocab_size=2147483647", "parallel.tp=2"], 2, "tp degrees that divide all of them: [1]"),
])
def test_huge_values_are_refused_at_once(overrides, world, needle):
    with pytest.raises(ConfigError) as err:
        validate_config(_compose(*overrides), world_size=world)
    assert needle in str(err.value), str(err.value)


def test_an_elastic_range_is_checked_at_every_world_size_it_may_form(monkeypatch):
    """torchrun --nnodes=1:3 --nproc-per-node=1: the launcher's check gets world sizes 1, 2 and 3. The group forms at
    3 once every node joined: a layout that fails there is refused; one that fails only at a smaller size (a group
    re-formed after a node is lost) is a warning naming it."""
    from trainer.preflight import CHECK_WORLD_SIZES_ENV, world_size_of

    monkeypatch.setenv(CHECK_WORLD_SIZES_ENV, "1,2,3")
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = _compose("check_only=true")  # a global batch of 16 in micro-batches of 8: over 1 or 2 ranks, not 3
    assert world_size_of(cfg) == (1, 2, 3)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size_of(cfg))
    assert ("at world size 3, the largest of the elastic range 1 to 3 (the group torchrun forms once every node "
            "joined; world sizes [1, 2] of the range work): training.global_batch_size=16 is not divisible by "
            "dp_size (3)") in str(err.value)
    one_by_one = ["check_only=true", "training.global_batch_size=12", "training.micro_batch_size=1"]
    [warning] = validate_config(_compose(*one_by_one), (1, 2, 3, 4, 5, 6))
    assert warning.startswith("world sizes [5] of the elastic range 1 to 6 cannot run this layout, so a group "
                              "re-formed at one of them (after a node is lost) stops with exit 2 on every restart (at "
                              "5: "), warning
    assert "the range's world sizes that work: [1, 2, 3, 4, 6]; launch with --nnodes 6 (min = max)" in warning
    assert validate_config(_compose(*one_by_one), (1, 2, 3)) == []
    assert world_size_of(_compose()) == 1  # a worker (not check_only) runs at its WORLD_SIZE


def test_cuda_asked_for_without_cuda_is_refused(tmp_path, pydoc_data):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = _compose(f"data.path={pydoc_data}", f"output_root={tmp_path}", "parallel.device=cuda")
    with pytest.raises(ConfigError, match="parallel.device=cuda, but torch sees no CUDA device here"):
        validate_config(cfg, world_size=1, files=True)


def test_a_permanent_tier_no_save_reaches_is_a_warning(tmp_path, pydoc_data):
    cfg = _compose(f"data.path={pydoc_data}", f"output_root={tmp_path}", "checkpoint.keep_every=15",
                   "checkpoint.interval=10")
    assert validate_config(cfg, world_size=1, files=True) == [
        "checkpoint.keep_every=15 is not a multiple of checkpoint.interval=10: saves fall on multiples of 10, so only "
        "steps divisible by 30 are kept; set keep_every to a multiple of interval"]
    cfg = _compose(f"data.path={pydoc_data}", f"output_root={tmp_path}", "checkpoint.keep_every=20",
                   "checkpoint.interval=10")
    assert validate_config(cfg, world_size=1, files=True) == []


@pytest.mark.distributed
def test_train_py_refuses_data_and_folder_mistakes_before_building(tmp_path, pydoc_data):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    proc, run_dir = _train(tmp_path, f"data.path={pydoc_data}", "model.vocab_size=100", f"checkpoint.dir={blocker}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout and "model.vocab_size=100" in proc.stderr
    assert f"checkpoint.dir={blocker}: {blocker} is a regular file" in proc.stderr
    assert not run_dir.exists() and blocker.read_text() == "not a folder"


# ---- under torchrun: one block, and exit 2 through the project's launcher ----

@pytest.mark.distributed
def test_under_torchrun_one_rank_prints_the_block(tmp_path):
    proc = run(torchrun(2, str(ROOT / "train.py"), "+experiment=debug", f"output_root={tmp_path}", "run_name=run",
                        "optim.lr=nan"), timeout=120)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("ConfigError: invalid configuration:") == 1, proc.stderr[-3000:]
    assert "optim.lr=nan must be" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.distributed
def test_the_launcher_checks_once_and_exits_2_without_an_agent_traceback(tmp_path):
    """scripts/launch_single_node.sh (its preemption_env.sh, then torchrun_preemptible.py's check): a grace that is
    not a number reaches the config check too, and is refused there with the rest."""
    proc = run(["bash", "scripts/launch_single_node.sh", "+experiment=debug", f"output_root={tmp_path}",
                "run_name=run", "+training.setps=10", "parallel.tp=3", "recovery.preemption_grace_s=nan"],
               timeout=300, env=subprocess_env({"NPROC": "2", "PYTHON": sys.executable}))
    assert proc.returncode == 2, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert out.count("error: ConfigError: invalid configuration:") == 1 and "Traceback" not in out
    assert "ChildFailedError" not in out and "did you mean training.steps?" in out
    assert "world size 2 is not divisible by parallel.dp_replicate (1) x parallel.tp (3)" in out  # the world it gets
    assert "recovery.preemption_grace_s=nan must be" in out
    assert not (tmp_path / "run").exists()


def _check_env(monkeypatch, argv, status=0, output="", **environ):
    """torchrun_preemptible.check_config(argv) with its check's process stood in for: (its status, the
    environment and keyword arguments the check was started with, or None when none was started)."""
    script = load_script("torchrun_preemptible")
    seen = []
    monkeypatch.setattr(script.subprocess, "run", lambda cmd, env, **kw: seen.append((env, kw)) or
                        subprocess.CompletedProcess(cmd, status, output, output))
    for key in ("SLURM_NODEID", "PET_NODE_RANK", "PET_NNODES", "PET_NPROC_PER_NODE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    code = script.check_config(argv)
    return code, (seen[-1] if seen else None)


def test_the_launchers_check_sees_every_world_size_of_an_elastic_range(monkeypatch):
    code, (env, _) = _check_env(monkeypatch, ["--nnodes=2:4", "--nproc-per-node=8", "--rdzv-backend=c10d",
                                              "--rdzv-endpoint=localhost:29400", "train.py", "seed=1"])
    assert code == 0 and env["WORLD_SIZE"] == "16" and env["LOCAL_WORLD_SIZE"] == "8"
    assert env["TRAINER_CHECK_WORLD_SIZES"] == "16,24,32"
    code, (env, _) = _check_env(monkeypatch, ["--standalone", "--nproc-per-node=2", "train.py"])
    assert code == 0 and env["WORLD_SIZE"] == "2" and "TRAINER_CHECK_WORLD_SIZES" not in env


def test_the_launchers_check_resolves_the_layout_as_torchrun_does(monkeypatch, capsys):
    import torch

    code, started = _check_env(monkeypatch, ["--standalone", "--nproc-per-node=gpu", "train.py"])
    if torch.cuda.is_available():  # the world of the devices torchrun will start a process for
        assert code == 0 and started[0]["WORLD_SIZE"] == str(torch.cuda.device_count())
    else:  # torchrun itself would stop with a traceback: a refusal, and no check started
        assert code == 2 and started is None
        assert "--nproc-per-node=gpu --nnodes=1:1: Cuda is not available." in capsys.readouterr().err
    code, started = _check_env(monkeypatch, ["--nnodes=4:2", "--nproc-per-node=2", "train.py"])
    assert code == 2 and started is None and "MIN <= MAX" in capsys.readouterr().err
    for bad, needle in (("--rdzv-endpoint=node0:abc", "must be an integer between 0 and 65536"),
                        ("--rdzv-conf=join_timeout=abc", "join_timeout=abc must be whole numbers")):
        code, started = _check_env(monkeypatch, ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", bad,
                                                 "train.py"])
        assert code == 2 and started is None and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, environ, prints", [
    (["--standalone", "--nproc-per-node=2"], {}, True),
    (["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29400"], {}, True),
    (["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=192.0.2.7:29400"], {}, False),
    (["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=192.0.2.7:29400",
      "--rdzv-conf=is_host=false"], {}, True),  # the store runs elsewhere: no agent can tell it is the first
    (["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29400"],
     {"SLURM_NODEID": "1"}, False),
    (["--nnodes=2", "--nproc-per-node=2", "--node-rank=1", "--master-addr=192.0.2.7"], {}, False),
    (["--nnodes=2", "--nproc-per-node=2", "--node-rank=0", "--master-addr=192.0.2.7"], {}, True),
])
def test_one_agent_of_a_multi_node_launch_prints_the_refusal(monkeypatch, capsys, argv, environ, prints):
    code, (_, kwargs) = _check_env(monkeypatch, [*argv, "train.py", "seed=-1"], status=2, output="the block",
                                   **environ)
    err = capsys.readouterr().err
    assert code == 2 and ("capture_output" not in kwargs) == prints
    assert ("refused this launch here too (exit 2); the first node prints why" in err) == (not prints)


def test_the_workers_of_a_checked_launch_print_no_warning_again(monkeypatch):
    """The agent's check printed the warnings: its workers run the same checks silently (TRAINER_CONFIG_CHECKED);
    a TORCH_ELASTIC_SHUTDOWN_TIMEOUT torchrun cannot read is refused before any worker starts."""
    script = load_script("torchrun_preemptible")
    started = []
    monkeypatch.setattr(script, "check_config", lambda argv: 0)
    monkeypatch.setattr(script, "torchrun_main", lambda: started.append(os.environ.get("TRAINER_CONFIG_CHECKED")))
    monkeypatch.setattr(script.NoticeForwarder, "install", lambda self: None)
    monkeypatch.setattr(sys, "argv", ["torchrun_preemptible.py", "--standalone", "train.py"])
    monkeypatch.setenv("TRAINER_CONFIG_CHECKED", "")  # main() sets it in this process: put back at the end
    monkeypatch.delenv("TRAINER_CONFIG_CHECKED")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "150")
    script.main()
    assert started == ["1"]
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "1e3")
    with pytest.raises(SystemExit) as exit_:
        script.main()
    assert exit_.value.code == 2 and started == ["1"]


@pytest.mark.distributed
def test_train_py_prints_a_warning_unless_the_launcher_did(tmp_path, pydoc_data):
    overrides = [f"data.path={pydoc_data}", f"output_root={tmp_path}", "checkpoint.keep_every=15",
                 "checkpoint.interval=10", "check_only=true"]
    warning = "warning: checkpoint.keep_every=15 is not a multiple of checkpoint.interval=10"
    alone = run_train(overrides)
    assert alone.stderr.count(warning) == 1 and "configuration accepted" in alone.stderr
    under_launcher = run_train(overrides, extra_env={"TRAINER_CONFIG_CHECKED": "1"})
    assert warning not in under_launcher.stderr and "configuration accepted" in under_launcher.stderr


def test_resume_must_with_a_mistyped_dir_gives_the_fix_and_creates_nothing(tmp_path, pydoc_data):
    (tmp_path / "real" / "checkpoints").mkdir(parents=True)
    typo = tmp_path / "reel" / "checkpoints"
    cfg = _compose(f"data.path={pydoc_data}", f"output_root={tmp_path}", "run_name=real", f"checkpoint.dir={typo}",
                   "checkpoint.resume=must")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=1, files=True)
    assert (f"checkpoint.resume=must but {typo} holds no usable committed checkpoint. {typo} does not exist: check "
            f"checkpoint.dir and run_name for a typo (runs with checkpoints under output_root={tmp_path}: ['real'])"
            ) in str(err.value)
    assert not (tmp_path / "reel").exists()


@pytest.mark.parametrize("retries, backoff_s, said", [
    (5, 2.0, None),  # 62 s of waits: under 120 s
    (6, 2.0, "wait 126 s in all"),
    (10**18, 2.0, "at least 126 s (from 6 retries on)"),  # no 2**(10**18)
    (10**18, 1e-200, "at least 196 s (from 672 retries on)"),  # a tiny backoff still adds up
    (1, 1e300, "wait 1e+300 s in all"),
    (7, float("nan"), None), (7, float("inf"), None), (0, 2.0, None),  # the values' own checks refuse these
])
def test_the_read_retries_bound_takes_any_number(retries, backoff_s, said):
    from recovery.config import read_retries_problem

    problem = read_retries_problem(retries, backoff_s, 600.0, 120.0)
    assert (problem is None) if said is None else (said in problem and "fails after 120 s" in problem), problem
