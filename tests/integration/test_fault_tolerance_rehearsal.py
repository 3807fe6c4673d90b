"""parallel.fault_tolerance's acceptance rehearsal (marked rehearsal: .ci/run runs it after the suite): two replica
groups of 2 ranks each (FSDP2 dp_shard 2 inside each group, torchft across them), saving asynchronously every 2
steps into their shared checkpoint folder (each step's save by the first group of its quorum). Group 1 is
SIGKILLed twice inside the gradient step (the fault fires on one of its ranks just before the all-reduce across
groups, while the peers are in it), restarted each time (it resumes from the newest durable checkpoint, then takes
the live state), then both groups are SIGKILLed from outside and restarted together: group 0 resumes from the
newest durable checkpoint, group 1 (started once group 0 has stepped) takes the live state from it. Throughout,
every step trains on the uninterrupted run's global batch and its losses stay within RTOL; both groups end with
bitwise equal weights, rank by rank. It prints the measured pauses and rejoin times.
Then the guards, the memory tier and the watchdog with groups: a bit flip no loss notices in one group of 2 ranks
(both groups roll back alike), a rollback with nothing to go back to (both stop, each saying why), the memory tier
through one group's loss and every group's, and a survivor waiting for a hung peer under the watchdog.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

import pytest

from metrics.records import read_metrics, step_losses
from support.launch import run_train
from support.processes import stop
from support.replicas import (
    Group,
    check_global_batches,
    check_rollback_pair,
    lighthouse,
    losses_of,
    overrides,
    start_in_order,
    wait_for,
)

pytestmark = [pytest.mark.distributed, pytest.mark.rehearsal]
RTOL = 1e-5
STEPS = 36


def _faults(*entries: str) -> str:
    return "[" + ", ".join(["{kind: slow, phase: step, step: -1, rank: -1, delay_s: 0.4}", *entries]) + "]"


def test_hsdp_groups_through_two_kills_in_the_all_reduce_and_a_cold_restart(tmp_path, pydoc_data):
    baseline = tmp_path / "baseline"  # the uninterrupted run: one process, no fault tolerance
    run_train(overrides(baseline, pydoc_data, STEPS))
    expected = step_losses(baseline)

    root = tmp_path / "ft"
    root.mkdir()
    saves = {"checkpoint.interval": 2, "checkpoint.async_mode": "async", "checkpoint.keep_last": 3}
    kills = _faults("{kind: sigkill, phase: gradients, step: 10, rank: 0}",
                    "{kind: sigkill, phase: gradients, step: 18, rank: 1}")
    with lighthouse(tmp_path / "lighthouse.log") as address:
        first = Group(root, pydoc_data, STEPS, address, 0, nproc=2, extra={**saves, "+recovery.faults": _faults()})
        second = Group(root, pydoc_data, STEPS, address, 1, nproc=2, extra={**saves, "+recovery.faults": kills})
        try:
            start_in_order(first, second)
            for _ in range(2):  # each kill inside the all-reduce: group 1 stops, the test restarts it
                code = second.proc.wait(240)
                assert code != 0, f"group 1 finished ({code}) before its fault:\n{second.text()}"
                second.start()
            wait_for("both groups in step 26", lambda: any(r["step"] >= 26 and r["participants"] == 2
                                                            for r in first.rows()), [first, second])
            stop(first.proc)  # every group lost: SIGKILL from outside, both together
            stop(second.proc)
            start_in_order(first, second)  # group 0 from its durable checkpoint; group 1 takes its state
            first.finish()
            second.finish()
        finally:
            first.close()
            second.close()

    rows0, rows1 = first.rows(), second.rows()
    voted_away = [r["step"] for r in rows0 if not r["committed"]]
    assert {10, 18} <= set(voted_away), f"each kill in the all-reduce voids that step on the survivor: {voted_away}"
    committed = check_global_batches(rows0, rows1, STEPS, unlogged=3)
    losses = losses_of(first, second)
    worst = max(abs(losses[k] - expected[k]) / abs(expected[k]) for k in expected)
    assert worst <= RTOL, worst
    a, b = first.digests(), second.digests()
    assert [d["weights_sha256"] for d in a] == [d["weights_sha256"] for d in b] and len(a) == 2
    cold = [r for r in rows1 if r["healed"] and r["started"] > second.launches[3]]
    assert cold, "after losing every group, group 1 took group 0's state (resumed from its durable checkpoint)"
    restarted = [r for r in rows0 if r["committed"] and r["started"] > first.launches[1]]
    # the step's row from either group (whichever wrote that checkpoint; a group left out of a step has none)
    before = {r["step"]: r for r in rows1 + rows0 if r["committed"] and r["started"] < first.launches[1]}
    resumed_at = restarted[0]["step"] - 1  # the checkpoint's step
    assert resumed_at % 2 == 0 and restarted[0]["batches_committed"] == \
        before[resumed_at]["batches_committed"] + restarted[0]["participants"], "torchft's count is the checkpoint's"
    _report(rows0, rows1, second.launches, committed, voted_away, worst)


def _report(rows0, rows1, launches, committed, voted_away, worst) -> None:
    """The numbers docs/measurements.md records: the survivor's pause per failure, the rejoin split, the step
    time alone and together."""
    together = [r["step_s"] for r in committed if r["participants"] == 2]  # train_step alone (no injected delay)
    alone = [r["step_s"] for r in committed if r["participants"] == 1]
    ordered = sorted(rows0, key=lambda r: r["time"])
    gaps = [after["time"] - before["time"] for before, after in zip(ordered, ordered[1:])]
    normal = statistics.median(gaps)  # a step's interval, the injected delay included
    done = [r for r in ordered if r["committed"]]
    pauses = []  # per kill inside the all-reduce: from the last step before it to the first step after, less a step
    for lost in (r for r in ordered if not r["committed"]):
        before = max((r for r in done if r["time"] < lost["time"]), key=lambda r: r["time"])
        after = min((r for r in done if r["time"] > lost["time"]), key=lambda r: r["time"])
        pauses.append(round(after["time"] - before["time"] - normal, 2))
    for launch in launches[1:3]:  # the two restarts after a kill inside the all-reduce
        healed = next((r for r in rows1 if r["healed"] and r["started"] > launch), None)
        assert healed is not None, f"group 1's restart at {launch:.2f} never took the live state: {rows1}"
        print(f"rejoin: start-up {healed['started'] - launch:.2f} s, quorum and transfer {healed['quorum_s']:.2f} s "
              f"(transfer {healed['transfer_s']:.3f} s, load {healed['load_s']:.3f} s), first step "
              f"{healed['step_s']:.2f} s")
    print(f"survivor's pause per kill, over a normal step interval ({normal:.2f} s): {pauses} s; steps voted away: "
          f"{voted_away}; train_step together {statistics.median(together):.3f} s (median), alone "
          f"{statistics.median(alone) if alone else float('nan'):.3f} s; max relative loss difference {worst:.2e}")


def test_a_flip_no_loss_notices_is_caught_by_the_fingerprints_across_groups(tmp_path, pydoc_data):
    """Two groups of two ranks (FSDP2 inside each), bit 0 of a weight flipped on group 1's rank 0 only: no loss or
    gradient alarm, but the weights' fingerprints compared across the groups every 4 steps
    (recovery.guards.replica_interval) differ at step 12 on rank 0 (rank 1's shards agree: the group's ranks agree
    the alarm): both groups raise the replica alarm there and roll back to group 0's checkpoint of step 8, as one
    process does after the louder flip (check_rollback_pair), and every rank ends bitwise equal to its peer."""
    check_rollback_pair(tmp_path, pydoc_data, bit=0, extra={"recovery.guards.replica_interval": 4},
                        alarms=[(12, "rollback")], nproc=2)



def test_the_memory_tier_with_groups_one_lost_then_every_group_lost(tmp_path, pydoc_data):
    """checkpoint.memory with replica groups, one memory root for both (as the launcher's groups share one run_name
    on a host): group 0, which writes the durable checkpoints, takes the snapshots too, in root/group_0; group 1
    takes none. Group 1 SIGKILLed and restarted takes the live state from group 0; then both SIGKILLed and
    restarted: group 0 resumes its snapshot (no durable checkpoint exists), group 1 takes the state from it. Every
    step trains the global batch, the losses stay within RTOL of one process, the weights end bitwise equal."""
    steps = 30
    baseline = tmp_path / "baseline"
    run_train(overrides(baseline, pydoc_data, steps))
    expected = step_losses(baseline)

    root, shm = tmp_path / "ft", tmp_path / "shm"
    root.mkdir()
    memory = {"checkpoint.memory.interval": 2, "checkpoint.memory.root": shm, "checkpoint.memory.replicas": 0,
              "+recovery.faults": _faults().replace("0.4", "0.25")}
    with lighthouse(tmp_path / "lighthouse.log") as address:
        first, second = (Group(root, pydoc_data, steps, address, g, extra=memory) for g in (0, 1))
        try:
            start_in_order(first, second, together_at=10)
            stop(second.proc)  # one group lost
            second.start()
            wait_for("both groups in step 18", lambda: any(r["step"] >= 18 and r["participants"] == 2 and
                                                            r["started"] > second.launches[1]
                                                            for r in second.rows()), [first, second])
            stop(first.proc)  # every group lost, the nodes (the memory root) live
            stop(second.proc)
            start_in_order(first, second)  # group 0 from its snapshot; group 1 takes its state
            first.finish()
            second.finish()
        finally:
            first.close()
            second.close()

    resumes = [read_metrics(g.run_dir, "resume") for g in (first, second)]
    assert [r["source"] for r in resumes[0]] == ["memory"] and resumes[1] == [], resumes
    assert Path(resumes[0][0]["path"]).parent == shm / "group_0" and resumes[0][0]["step"] >= 10, resumes[0]
    assert not (shm / "group_1").exists() and not any(p.name.startswith("step_") for p in shm.iterdir())
    for launch in second.launches[1:]:  # each restart of group 1 took the live state from group 0
        assert [r for r in second.rows() if r["healed"] and r["started"] > launch], launch
    check_global_batches(first.rows(), second.rows(), steps, unlogged=2)
    losses = losses_of(first, second)
    worst = max(abs(losses[k] - expected[k]) / abs(expected[k]) for k in expected)
    assert worst <= RTOL, worst
    (a,), (b,) = first.digests(), second.digests()
    assert a["weights_sha256"] == b["weights_sha256"] and a["step"] == b["step"] == steps


def test_the_watchdog_lets_a_survivor_wait_for_a_hung_peer_within_the_checked_timeouts(tmp_path, pydoc_data):
    """The watchdog on, its timeouts just above what the config check asks of them (recovery.timeouts.step above
    parallel.fault_tolerance.timeout_s, data_wait above quorum_timeout_s + timeout_s), and group 1 SIGSTOPped
    mid-run (a hung peer: its sockets stay open, so the survivor waits in the all-reduce until torchft's timeout,
    then for the Lighthouse to drop the peer): group 0 waits, is not aborted, and finishes every step alone."""
    steps, timeout = 40, 3
    root = tmp_path / "ft"
    root.mkdir()
    tight = {"parallel.fault_tolerance.timeout_s": timeout, "parallel.fault_tolerance.quorum_timeout_s": timeout,
             "recovery.timeouts.step": timeout + 1, "recovery.timeouts.data_wait": 2 * timeout + 1,
             "+recovery.faults": _faults().replace("0.4", "0.1")}
    # the hung peer is dropped 1 s after its last heartbeat: within one quorum_timeout_s of the survivor's ask
    with lighthouse(tmp_path / "lighthouse.log", heartbeat_ms=1000) as address:
        first, second = (Group(root, pydoc_data, steps, address, g, extra=tight) for g in (0, 1))
        try:
            start_in_order(first, second, together_at=6)
            second.send(signal.SIGSTOP)  # hung, not dead
            hung = time.time()
            first.finish(180)
        finally:
            if second.proc is not None and second.proc.poll() is None:  # stopped, not ended: let it end
                os.kill(second.proc.pid, signal.SIGCONT)
            first.close()
            second.close()

    rows = first.rows()
    assert len(first.launches) == 1 and sorted(r["step"] for r in rows if r["committed"]) == list(range(1, steps + 1))
    assert not list((first.run_dir / "watchdog").glob("*")), "the watchdog fired on the survivor"
    ordered = sorted(rows, key=lambda r: r["time"])
    waited = max(b["time"] - a["time"] for a, b in zip(ordered, ordered[1:]) if b["time"] > hung)
    alone = [r["step"] for r in rows if r["committed"] and r["participants"] == 1 and r["started"] > hung]
    print(f"watchdog: the survivor waited {waited:.2f} s for its hung peer (step timeout {timeout + 1} s), then "
          f"trained steps {alone[0]}..{alone[-1]} alone")
    assert waited > 1.0 and alone and alone[-1] == steps


def test_a_rollback_with_nothing_to_go_back_to_stops_every_group_with_the_reason(tmp_path, pydoc_data):
    """The error path of the guards' agreement: a bit flip in group 1 alone, no checkpoint saved. At step 12 both
    groups agree to roll back, group 0 finds no verified checkpoint and raises; group 1, waiting for its target,
    learns it at the next agreement point and stops too, naming group 0: no group hangs, neither trains on."""
    fault = "[{kind: bitflip_param, phase: step, step: 10, rank: 0}]"
    root = tmp_path / "ft"
    root.mkdir()
    both = {"parallel.fault_tolerance.min_replicas": 2}
    with lighthouse(tmp_path / "lighthouse.log") as address:
        groups = [Group(root, pydoc_data, 16, address, 0, extra=both),
                  Group(root, pydoc_data, 16, address, 1, extra={**both, "+recovery.faults": fault})]
        try:
            for group in groups:
                group.start()
            codes = [group.proc.wait(180) for group in groups]
        finally:
            for group in groups:
                group.close()
    assert codes[0] != 0 and codes[1] != 0, codes
    assert "holds no verified checkpoint before step 12" in groups[0].text()
    assert "the replica group that writes the durable checkpoints could not roll back" in groups[1].text()
    assert [max(r["step"] for r in group.rows() if r["committed"]) for group in groups] == [12, 12]
