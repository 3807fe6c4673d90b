"""Decisions at start-up and around a rollback are made once and agreed, in-process: this process
plays rank 1 of a torchrun job (the collectives stand in for rank 0's answers), or rank 0 whose
storage fails. Real processes: tests/integration/test_convert_hf.py (rank 1 unable to read any manifest
or config.json), tests/integration/test_live_owner.py (two launches at once),
tests/integration/test_checkpoint_trust.py (EIO on rank 0's manifest reads), tests/integration/test_bad_inputs.py
(one block under torchrun)."""

from __future__ import annotations

import errno
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

import checkpoint.checks
from checkpoint.durable import discovery, reads
from checkpoint.durable.manifest import CheckpointError, CheckpointUnreadable, storage_failure
from checkpoint.durable.preflight import PreflightError
from checkpoint.interop.weight_source import SourceError
from checkpoint.manager import CheckpointManager
from configs.keys import ConfigError
from data import setup
from parallel import collectives
from support.config import compose_debug as _compose
from trainer import preflight as startup
from trainer.config import register
from trainer.preflight import validate_config

register()


def _as_rank_1(monkeypatch, rank0_answer, rank0_sees=([], [])):
    """This process is rank 1 of 2: the broadcast gives rank 0's answer, the gather rank 0's findings, the
    polls while rank 0 decides find it done."""
    sent = []
    monkeypatch.setattr(collectives, "distributed", lambda: True)
    monkeypatch.setattr(collectives.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(collectives, "any_rank", lambda flag, group=None: flag)
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, *a, **k: sent.append(obj) or rank0_answer)
    monkeypatch.setattr(collectives, "all_gather_object", lambda obj, *a, **k: [rank0_sees, obj])
    return sent


def test_rank_1_reads_no_shared_file_and_takes_rank_0s_verdict(monkeypatch, tmp_path, pydoc_data):
    """Rank 0 found checkpoint.resume=WEIGHTS holds weights only and checkpoint.dir a live owner, and its
    data.path unprepared: rank 1 applies the same config change and raises the same block, having read
    no manifest, no lease record and no listing itself."""
    weights = tmp_path / "weights"
    cfg = _compose(f"data.path={pydoc_data}", f"output_root={tmp_path}", "run_name=run",
                   f"checkpoint.resume={weights}")
    live = f"checkpoint.dir: {tmp_path}/run/checkpoints is in use by a live run: attempt 3 (pid 4242 on node-0)"
    changes = {"checkpoint.resume": "auto", "model.init_from": str(weights)}
    sent = _as_rank_1(monkeypatch, [(changes, [live]), None], rank0_sees=(["data.path: not prepared on node 0"], []))

    def must_not_read(*args, **kwargs):
        raise AssertionError("rank 1 read a shared file")
    for module, name in ((checkpoint.checks, "weights_only_resume"), (checkpoint.checks, "file_problems"),
                         (checkpoint.checks, "live_owner"), (startup, "fill_from_files"),
                         (discovery, "list_checkpoints")):
        monkeypatch.setattr(module, name, must_not_read)
    with pytest.raises(ConfigError) as err:
        startup.check_launch(cfg, 2)
    assert err.value.agreed  # train.py prints it on rank 0 only; every rank exits 2
    assert str(err.value) == ("invalid configuration:\n  - data.path: not prepared on node 0 (on 1 of 2 ranks: 0)\n"
                              f"  - {live}")
    assert (cfg.checkpoint.resume, cfg.model.init_from) == ("auto", str(weights))  # rank 0's change, here too
    assert sent == [[None, None]]  # rank 1 decided nothing of its own


def test_alone_the_launch_checks_give_validate_configs_block(tmp_path, pydoc_data):
    """A lone process (python train.py) refuses with the block it always gave."""
    overrides = [f"data.path={pydoc_data}", f"output_root={tmp_path}", "run_name=run", "optim.lr=-1",
                 "checkpoint.resume=7", f"checkpoint.dir={tmp_path / 'none'}"]
    with pytest.raises(ConfigError) as expected:
        validate_config(_compose(*overrides), 1, files=True)
    with pytest.raises(ConfigError) as got:
        startup.check_launch(_compose(*overrides), 1)
    assert str(got.value) == str(expected.value) and "optim.lr=-1" in str(got.value)


def test_rank_0_reads_again_while_the_storage_fails_and_every_rank_gets_its_answer(monkeypatch, caplog):
    calls = []

    def flaky(fails: int, error=OSError(errno.EIO, "Input/output error")):
        def read():
            calls.append(1)
            if len(calls) <= fails:
                raise error
            return "step_00000008"
        return read

    assert reads.read_on_rank0(flaky(2), "checkpoint.dir=/x", retries=3, backoff_s=0.0) == "step_00000008"
    assert len(calls) == 3 and caplog.text.count("reading again") == 2
    calls.clear()
    with pytest.raises(CheckpointUnreadable, match="checkpoint.dir=/x could not be read after 2 retries"):
        reads.read_on_rank0(flaky(9), "checkpoint.dir=/x", retries=2, backoff_s=0.0)
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(OSError):  # a missing file answers the same on a second look: not read again
        reads.read_on_rank0(flaky(1, FileNotFoundError(errno.ENOENT, "gone")), "x", retries=3, backoff_s=0.0)
    assert len(calls) == 1
    # an ESTALE under a config error (model=hf's shape, read through a SourceError) is the storage's too
    source = SourceError("model.init_from=/w: unreadable")
    source.__cause__ = OSError(errno.ESTALE, "Stale file handle")
    shape = ConfigError("model=hf reads the model's shape from model.init_from")
    shape.__cause__ = source
    assert storage_failure(shape).errno == errno.ESTALE and storage_failure(ConfigError("optim.lr=-1")) is None
    # rank 1: rank 0's failure arrives as the same error
    _as_rank_1(monkeypatch, [None, (0, "checkpoint.dir=/x could not be read after 3 retries: EIO")])
    with pytest.raises(CheckpointUnreadable, match="could not be read after 3 retries"):
        reads.read_on_rank0(flaky(0), "checkpoint.dir=/x")


def test_a_rollback_waits_for_retention_in_bounded_polls_every_rank_joins(monkeypatch):
    """Rank 0's retention may delete terabytes: a rollback waits for it, but in polls of poll_s that every
    rank joins (an agreed flag), so no rank sits in one collective longer than that. Here rank 0 (its
    retention busy for 0.4 s), then rank 1 (nothing queued; rank 0 busy for three polls)."""
    release, polls = threading.Event(), []
    with ThreadPoolExecutor(1) as housekeeping:
        rank0 = SimpleNamespace(_housekeeping=housekeeping)
        rank0._housekeeping.submit(release.wait)
        monkeypatch.setattr(collectives, "any_rank", lambda flag, group=None: polls.append(flag) or flag)
        threading.Timer(0.4, release.set).start()
        CheckpointManager.wait_for_retention(rank0, poll_s=0.05)
    assert polls[-1] is False and polls.count(True) >= 3, polls
    busy = iter([True, True, True])
    polls.clear()
    monkeypatch.setattr(collectives, "any_rank", lambda flag, group=None: polls.append(flag) or next(busy, flag))
    with ThreadPoolExecutor(1) as housekeeping:
        CheckpointManager.wait_for_retention(SimpleNamespace(_housekeeping=housekeeping), poll_s=0.05)
    assert polls == [False] * 4  # its own flag each time, in each of rank 0's polls


def test_every_rank_enters_the_data_agreement_whatever_it_found(monkeypatch, tmp_path):
    """prepare_if_missing: a node that looks after another has finished sees the data prepared; its
    ranks must still enter the agreement the others enter (on a failure, rank 0's DataError on every rank)."""
    agreements = []
    monkeypatch.setattr(setup.collectives, "agree_on_problems", lambda problem, group=None: agreements.append(problem))
    monkeypatch.setattr(setup, "is_prepared", lambda path: True)
    data = OmegaConf.create({"path": str(tmp_path / "data"), "prepare_if_missing": True, "mixture": []})
    for local_rank in (0, 1):
        setup.prepare_if_missing(data, SimpleNamespace(local_rank=local_rank))
    assert agreements == [None, None]
    data.prepare_if_missing = False
    setup.prepare_if_missing(data, SimpleNamespace(local_rank=0))
    assert agreements == [None, None]  # a config without it has no agreement on any rank


@pytest.mark.parametrize("rank0_raised, expected", [
    ((0, "the files of checkpoint.resume and model.init_from could not be read after 3 retries: EIO"),
     CheckpointUnreadable),
    ((2, "checkpoint.resume=8: step_00000008 has no manifest.json"), CheckpointError),
    ((3, "[Errno 13] Permission denied: '/ckpt/manifest.json'"), CheckpointUnreadable),
])
def test_a_read_that_failed_on_rank_0_is_raised_alike_and_printed_once(monkeypatch, tmp_path, pydoc_data,
                                                                       rank0_raised, expected):
    """Rank 0's reads ended in an error (retries spent, a damaged checkpoint, a permission refused):
    rank 1 raises the same kind, marked ``agreed``, so train.py prints it on rank 0 alone (an OSError
    is not a traceback on 512 ranks but one CheckpointError naming the fix)."""
    cfg = _compose(f"data.path={pydoc_data}", f"output_root={tmp_path}", "run_name=run")
    _as_rank_1(monkeypatch, [None, rank0_raised])
    with pytest.raises(expected) as err:
        startup.check_launch(cfg, 2)
    assert err.value.agreed and rank0_raised[1] in str(err.value)


def test_a_lease_rank_0_could_not_write_is_refused_alike(monkeypatch, tmp_path):
    """claim_lease: rank 0 could not write checkpoint.dir; every rank raises the same PreflightError, agreed."""
    cfg = _compose(f"output_root={tmp_path}", "run_name=run")
    _as_rank_1(monkeypatch, [None, (1, "[Errno 30] Read-only file system: '/ckpt'")])
    with pytest.raises(PreflightError, match="is not writable by this process.*Read-only file system") as err:
        startup.claim_lease(cfg.checkpoint)
    assert err.value.agreed


def test_init_froms_verification_is_one_block_whichever_rank_found_the_damage(monkeypatch):
    """model.init_from's files checked on every rank: rank 0 found a damaged file, rank 1 nothing.
    Both raise the same CheckpointError naming the file and the rank, marked agreed (printed once);
    before, rank 1 said "another rank" and rank 0 the file, each printing its own block."""
    from checkpoint.interop import init_from

    _as_rank_1(monkeypatch, None, rank0_sees="__0_0.distcp: xxh3_64 mismatch")
    with pytest.raises(CheckpointError) as err:
        init_from._refuse_if_any([], "model.init_from=/w/step_00000008 failed verification")
    assert str(err.value) == ("model.init_from=/w/step_00000008 failed verification: __0_0.distcp: xxh3_64 mismatch "
                              "(on 1 of 2 ranks: 0)") and err.value.agreed
    _as_rank_1(monkeypatch, [None, (0, "model.init_from=/w: config.json could not be read after 3 retries")])
    with pytest.raises(CheckpointUnreadable) as err:  # what rank 0's reads raised, here too
        reads.read_on_rank0(lambda: None, "model.init_from=/w")
    assert err.value.agreed
