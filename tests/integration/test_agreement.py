"""Decisions that change which collectives a rank runs are made once and agreed, tested with one
rank behaving differently from the others (real torchrun processes, gloo, the default config with
its guards on). On a rank-local decision each of these runs hangs or fails: the test bounds it."""

from __future__ import annotations

import json
import re

import pytest

from checkpoint.config import AUTO_MEASURE_STEPS
from recovery.interval import choose_interval_steps
from rehearsal.chains import faults_override
from rehearsal.runs import tiny_overrides
from support.launch import run, run_train, torchrun, worker

pytestmark = pytest.mark.distributed

BOUND_S = 300  # a run that disagrees hangs in a save's collectives: the test fails here instead


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("nproc", [2, 4])
def test_auto_interval_is_the_same_on_every_rank_when_one_rank_is_slower(tmp_path, pydoc_data, nproc):
    """The last rank is slower at every step, and its snapshots for a save block training 0.6 s longer
    (a slow host-memory copy): its own measurements ask for a longer interval than rank 0's. Every
    rank must save at the same steps."""
    run_dir = tmp_path / "slow"
    steps, slow = 36, nproc - 1
    faults = faults_override([
        {"kind": "slow", "phase": "step", "step": -1, "rank": slow, "delay_s": 0.03},
        {"kind": "slow", "phase": "checkpoint_snapshot", "step": -1, "rank": slow, "delay_s": 0.6}])
    proc = run_train(tiny_overrides(run_dir, pydoc_data, steps, "auto", keep_last=20, extra=[
        "recovery.device_mtbf_hours=0.0001", f"training.global_batch_size={2 * nproc}", faults]), nproc=nproc,
        timeout=BOUND_S)
    rows = _rows(run_dir)
    [ev] = [r for r in rows if r.get("kind") == "checkpoint_interval"]
    assert ev["blocking_s"] >= 0.6  # the slow rank's, not rank 0's own (milliseconds)
    again = choose_interval_steps(ev["step_s"], ev["blocking_s"], ev["write_s"], ev["mtbf_s"], max_steps=steps)
    assert ev["interval_steps"] == again.steps >= again.lower_bound_steps > 1, ev
    # every AUTO_MEASURE_STEPS until all ranks have measured their first save, then the chosen interval
    expected = list(range(AUTO_MEASURE_STEPS, ev["step"] + 1, AUTO_MEASURE_STEPS)) + \
        [s for s in range(ev["step"] + 1, steps) if s % again.steps == 0] + [steps]
    saved = [r["step"] for r in rows if r.get("kind") == "checkpoint"]
    assert saved == expected, (saved, ev, proc.stderr[-3000:])
    committed = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert committed == expected  # a DCP save commits only when every rank took part


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_shadow_alarm_on_one_replica_rolls_every_rank_back_together(tmp_path, pydoc_data, nproc):
    """dp_replicate=2 (x dp_shard=2 at 4 ranks): a bit flips in the last rank's shard of the final
    norm's weights after backward (this step's gradients do not see it), so only the probe (shadow)
    loss of that rank's replica turns non-finite. The alarm must roll back every rank, to the same
    checkpoint; alone, that replica would enter the rollback's collectives while the other trains
    on. (The replica check, which would see the flip on every rank of a replicate pair, is off
    here: this is the shadow check's agreement.)"""
    run_dir = tmp_path / "shadow"
    flip, last = 8, nproc - 1
    proc = run_train(tiny_overrides(run_dir, pydoc_data, 12, 4, keep_last=5, extra=[
        "parallel.dp_replicate=2", f"parallel.dp_shard={nproc // 2}", f"training.global_batch_size={2 * nproc}",
        "recovery.guards.shadow_interval=2", "recovery.guards.replica_interval=0",
        faults_override([{"kind": "bitflip_param", "phase": "gradients", "step": flip, "rank": last,
                          "param": "norm.weight"}])]), nproc=nproc, timeout=BOUND_S)
    for rank in range(nproc):
        assert re.search(rf"\[rank{rank}\] WARNING rolled back from step {flip} to verified checkpoint "
                         r"step_00000004", proc.stderr), proc.stderr[-4000:]
    record = json.loads((run_dir / "alarms" / f"step{flip:08d}-shadow.json").read_text())
    assert record["alarmed_on_ranks"] == list(range(nproc // 2, nproc)), record  # the flipped replica's ranks
    assert record["anomalies"][0]["source"] == "shadow_loss", record  # what that replica saw, on rank 0's record
    rows = _rows(run_dir)
    assert [r["to_step"] for r in rows if r.get("kind") == "rollback"] == [4]
    assert max(r["step"] for r in rows if "loss" in r) == 12


def test_a_decision_on_rank_0_longer_than_the_collective_timeout_reaches_every_rank():
    """Rank 0 decides for all (collectives.decided_on_rank0) for twice the collective timeout (2 s):
    an answer, an error the caller listed, one it did not (raised on rank 0 alone, it left rank 1 in the
    decision's broadcast while rank 0 went on to the next collective). The other rank waits in short agreed
    polls, not in one collective, so it gets each outcome instead of gloo's timeout, and both reach the next
    collective."""
    proc = run(torchrun(2, worker("rank0_slow_decision")), timeout=120)
    out, err = proc.stdout, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"DECIDED {rank} step_00000398" in out and f"DECIDED {rank} OSError: [Errno 5] the store did not " \
            "answer" in out, out + err
    assert "DECIDED 0 ValueError: bytes it did not expect" in out, out + err
    assert re.search(r"DECIDED 1 RankZeroFailed: .*ValueError: bytes it did not expect", out), out + err
    assert "BARRIER 0" in out and "BARRIER 1" in out and proc.returncode == 0, out + err


@pytest.mark.parametrize("scenario, outcome", [
    ("guards", "8 rolled_back=[8]"), ("quorum", "step=12 quorums=2 dp_rank=[{dp_rank}]"),
    ("quorum_fails", "RuntimeError: replica group 1: 3 quorums failed in a row (the last: {why}); is the Lighthouse "
                     "at stand-in up?")])
def test_a_peer_group_lost_part_way_leaves_this_groups_ranks_acting_as_one(scenario, outcome):
    """Under torchft each rank's all-reduce across groups goes to its own counterpart, and each rank configures its
    own process group at a quorum: a peer group killed mid-way can fail one rank's part and not another's. The
    group's ranks must still take one action, else their next collectives do not match. ``guards``: the writer's
    rollback to step 8 and its target reached rank 0 only; both must roll back to it (before: rank 0 rolled back
    alone, rank 1 trained on).
    ``quorum``: rank 1's part of the first quorum failed; both must ask again (before: rank 0 went on to the step
    while rank 1 waited in a second quorum, which torchft holds until every rank of the group asks).
    ``quorum_fails``: rank 1's part of every quorum failed; both stop after the same attempts, each naming what it
    saw last (before: rank 0's message said "(None)")."""
    proc = run(torchrun(2, worker("replica_groups_partial_loss"), scenario), timeout=120)  # group 1 of 2: dp ranks 2, 3
    out = proc.stdout
    outcomes = dict(re.findall(r"OUTCOME (\d) (.*)", out))
    why = ("on another rank of this group", "configuring the process group: the peer is gone")
    assert outcomes == {str(r): outcome.format(dp_rank=2 + r, why=why[r]) for r in (0, 1)}, out + proc.stderr[-3000:]
    assert "BARRIER 0" in out and "BARRIER 1" in out and proc.returncode == 0, out + proc.stderr[-3000:]
