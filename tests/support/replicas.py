"""Replica groups under torchft for the tests (parallel.fault_tolerance): a Lighthouse on loopback, a group's
run forked from the warm parent, its fault_tolerance.jsonl, and the check that every step trained on the
global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from metrics.records import read_metrics, step_losses
from recovery.fault_tolerance import LOG_NAME
from rehearsal.processes import free_port, kill_tree, wait_listening
from rehearsal.runs import debug_overrides
from support.launch import ROOT, python_or_torchrun, run_train
from support.processes import start, stop

GLOBAL, MICRO = 8, 2
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"


@contextmanager
def lighthouse(log_path: Path, heartbeat_ms: int = 3000) -> Iterator[str]:
    """A Lighthouse on 127.0.0.1, listening before this returns. A group without a heartbeat for ``heartbeat_ms``
    leaves the quorum; with two groups, a live one is always waited for (torchft: a quorum needs more than half of
    the heartbeating groups). The heartbeat is also each kill's pause for the survivor: 3 s, not the launchers' 5 s,
    for the tests' time; at 1 s a loaded CI machine once had a live group's heartbeat lapse (group 1 ran step 9 alone
    while group 0 saved)."""
    for attempt in range(3):  # another process may bind the picked port first: the Lighthouse exits, pick again
        port = free_port()
        with open(log_path, "w") as log:
            proc = subprocess.Popen([str(LIGHTHOUSE), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
                                     "--join_timeout_ms", "5000", "--quorum_tick_ms", "50",
                                     "--heartbeat_timeout_ms", str(heartbeat_ms)],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_listening(proc, port, "the Lighthouse")
            break
        except RuntimeError:
            kill_tree(proc.pid)
            proc.wait()
            if attempt == 2 or "Address already in use" not in log_path.read_text():
                raise RuntimeError(f"the Lighthouse did not start:\n{log_path.read_text()[-3000:]}") from None
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_tree(proc.pid)
        proc.wait()


def overrides(run_dir: Path, data: Path, steps: int, extra: Dict[str, object] | None = None) -> List[str]:
    return debug_overrides(run_dir, data, steps, {"training.global_batch_size": GLOBAL,
                                                  "training.micro_batch_size": MICRO, **(extra or {})})


class Group:
    """Replica group ``index``'s run in ``root/group_N`` (``nproc`` ranks), forked from the warm parent; the groups
    share ``root/checkpoints`` (as scripts/launch_fault_tolerant.sh's do)."""

    def __init__(self, root: Path, data: Path, steps: int, address: str, index: int, nproc: int = 1,
                 extra: Dict[str, object] | None = None):
        self.run_dir, self.index = root / f"group_{index}", index
        self.args = python_or_torchrun(nproc, str(ROOT / "train.py"), *overrides(self.run_dir, data, steps, {
            "parallel.fault_tolerance.enabled": "true", "parallel.fault_tolerance.lighthouse": address,
            "parallel.fault_tolerance.replica_id": index, "parallel.fault_tolerance.hostname": "127.0.0.1",
            "parallel.fault_tolerance.quorum_timeout_s": 30, "parallel.fault_tolerance.timeout_s": 10,
            "checkpoint.dir": root / "checkpoints", **(extra or {})}))  # one checkpoint.dir for every group
        self.root, self.proc, self.log, self.launches = root, None, None, []

    def start(self) -> "Group":
        if self.log is not None:
            self.log.close()
        self.log = open(self.root / f"group_{self.index}.{len(self.launches)}.log", "w")
        self.launches.append(time.time())
        self.proc = start(self.args, self.log, extra_env={"GLOO_SOCKET_IFNAME": "lo"}, warm=True)
        return self

    def text(self) -> str:
        return Path(self.log.name).read_text()[-6000:]

    def rows(self) -> List[dict]:
        """The group's fault_tolerance.jsonl, without a last line still being written."""
        path = self.run_dir / LOG_NAME
        text = path.read_text() if path.exists() else ""
        return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]

    def send(self, sig: signal.Signals) -> None:
        """``sig`` to the running group; a group that already ended fails the test with its log."""
        if self.proc.poll() is not None:
            raise AssertionError(f"group {self.index} ended ({self.proc.returncode}) before the test's {sig.name}:\n"
                                 f"{self.text()}")
        os.kill(self.proc.pid, sig)

    def finish(self, timeout: float = 300.0) -> None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop(self.proc)
            raise AssertionError(f"group {self.index} did not end within {timeout:.0f} s:\n{self.text()}") from None
        assert code == 0, f"group {self.index} failed ({code}):\n{self.text()}"

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)
        if self.log is not None:
            self.log.close()

    def digests(self) -> List[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.run_dir.glob("weights-rank*.json"))]


def wait_for(what: str, predicate, groups: List[Group], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for group in groups:
            if group.proc.poll() is not None:
                raise AssertionError(f"group {group.index} exited ({group.proc.returncode}) while waiting for "
                                     f"{what}:\n{group.text()}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"group {group.index}:\n{group.text()}" for group in groups)
            raise AssertionError(f"no {what} in {timeout} s:\n{logs}")
        time.sleep(0.05)


def start_in_order(first: Group, second: Group, together_at: Optional[int] = None) -> None:
    """``first`` started, then ``second`` once ``first`` ran a step of this launch: ``first`` runs every step and
    ``second`` joins at its first quorum, taking ``first``'s state (after a cold restart: the state ``first``
    resumed). With ``together_at``, until both groups ran a step >= it together."""
    first.start()
    launched = first.launches[-1]
    wait_for(f"group {first.index}'s first step", lambda: any(r["started"] > launched for r in first.rows()), [first])
    second.start()
    if together_at is not None:
        wait_for(f"both groups in step {together_at}", lambda: any(
            r["step"] >= together_at and r["participants"] == 2 for r in second.rows()), [first, second])


def check_global_batches(first: List[dict], second: List[dict], steps: int, unlogged: int = 1) -> List[dict]:
    """Every step trained on the uninterrupted run's global batch, by the groups of its quorum. A step's rows are its
    last committed attempt (a step re-run after a restart counts once), in either group: a group whose heartbeat
    lapsed (a loaded machine) is left out of a quorum, the other runs that step alone and sends it the state at the
    next quorum (seen in CI: group 1 ran step 9 alone while group 0 saved). With
    both groups in the quorum, the other group's row of that step joins it. The rows tile [(k - 1) x GLOBAL,
    k x GLOBAL) and their tokens add up to the global batch's. Up to ``unlogged`` steps may lack the other group's
    row: a kill between its commit and its log line. Returns the rows used, one per step."""
    groups = (first, second)
    final: Dict[int, tuple] = {}
    for _, g, row in sorted(((r["time"], g, r) for g, rows in enumerate(groups) for r in rows if r["committed"]),
                            key=lambda item: item[0]):
        final[row["step"]] = (g, row)
    assert sorted(final) == list(range(1, steps + 1)), f"committed steps {sorted(final)}"
    missing = []
    for k, (g, row) in sorted(final.items()):
        slices = [row]
        if row["participants"] == 2:
            peer = [r for r in groups[1 - g] if r["step"] == k and r["committed"] and r["participants"] == 2]
            if not peer:
                missing.append(k)
                continue
            slices.append(peer[-1])
        ranges = sorted(tuple(r["samples"]) for r in slices)
        assert ranges[0][0] == (k - 1) * GLOBAL and sum(c for _, c in ranges) == GLOBAL, (k, ranges)
        assert all(a + c == b for (a, c), (b, _) in zip(ranges, ranges[1:])), (k, ranges)
        assert sum(r["tokens"] for r in slices) == row["global_tokens"], (k, slices)
    assert len(missing) <= unlogged, f"steps without the other group's row: {missing}"
    return [final[k][1] for k in sorted(final)]


def losses_of(*groups: "Group") -> Dict[int, float]:
    """step -> loss, each step's from the first of ``groups`` that committed it (a step one group ran alone is in
    its log only; with both in the quorum the loss is the same sum in each)."""
    losses: Dict[int, float] = {}
    for group in reversed(groups):
        losses.update(step_losses(group.run_dir))
    return losses


def check_rollback_pair(tmp_path: Path, data: Path, bit: int, extra: Dict[str, object], alarms: List[tuple],
                        nproc: int = 1) -> None:
    """Two groups of ``nproc`` ranks (no step without both) saving every 4 steps, bit ``bit`` of a weight flipped
    at step 10 on group 1's rank 0 only: both groups raise ``alarms`` (step, action) and roll back at step 12 to
    group 0's checkpoint of step 8, skipping the data of steps 9 to 12 (group 1 taking the state from group 0);
    their losses are the same bits at every step and, within 1e-5, those of one process whose fault makes it roll
    back the same way (the top exponent bit: skipped at steps 10 and 11, rolled back at 12); every rank's final
    weights are bitwise equal to its peer's in the other group."""
    steps, fault = 16, f"[{{kind: bitflip_param, phase: step, step: 10, rank: 0, bit: {bit}}}]"
    baseline = tmp_path / "baseline"
    run_train(overrides(baseline, data, steps, {"checkpoint.interval": 4,
                                                "+recovery.faults": fault.replace(f"bit: {bit}", "bit: 30")}))
    expected = step_losses(baseline)
    assert [r["to_step"] for r in read_metrics(baseline, "rollback")] == [8]

    root = tmp_path / "ft"
    root.mkdir()
    both = {"parallel.fault_tolerance.min_replicas": 2, **extra}  # no step without both groups: the fault hits a pair
    with lighthouse(tmp_path / "lighthouse.log") as address:
        groups = [Group(root, data, steps, address, 0, nproc, extra={**both, "checkpoint.interval": 4}),
                  Group(root, data, steps, address, 1, nproc, extra={**both, "+recovery.faults": fault})]
        try:
            for group in groups:
                group.start()
            for group in groups:
                group.finish(240)
        finally:
            for group in groups:
                group.close()

    for group in groups:
        records = [json.loads(p.read_text()) for p in (group.run_dir / "alarms").glob("*.json")]
        assert sorted((r["step"], r["action"]) for r in records) == alarms, (group.index, records)
        assert [(r["step"], r["to_step"]) for r in read_metrics(group.run_dir, "rollback")] == [(12, 8)], group.index
        rerun = [r for r in group.rows() if r["step"] == 9 and r["committed"]][-1]  # the first step after it
        assert rerun["samples"] == [(8 + 4) * GLOBAL + group.index * GLOBAL // 2, GLOBAL // 2], rerun  # rank 0's
    assert [r for r in groups[1].rows() if r["healed"] and r["step"] == 9], "group 1 took group 0's state"
    losses = [step_losses(group.run_dir) for group in groups]
    assert losses[0] == losses[1], "both groups logged the same bits at every step"
    worst = max(abs(losses[0][k] - expected[k]) / abs(expected[k]) for k in expected)
    print(f"guards across groups (bit {bit}): max relative loss difference {worst:.2e} against one process")
    assert sorted(losses[0]) == sorted(expected) and worst <= 1e-5
    a, b = groups[0].digests(), groups[1].digests()
    assert len(a) == nproc and [(d["step"], d["weights_sha256"]) for d in a] == \
        [(steps, d["weights_sha256"]) for d in b], "every rank's weights bitwise equal to its peer's in the other group"
