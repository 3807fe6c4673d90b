"""parallel.fault_tolerance's durable saves: the replica groups share checkpoint.dir and the step's quorum names
the group that writes (its first participant: group 0 while it is in, else the lowest id that is).

Group 0 is SIGKILLed from outside and kept down across save intervals: group 1 writes committed checkpoints at
those steps; group 0 restarts (its own lease's next attempt: not refused, not a stale writer), heals from group
1 and writes again. Then both groups are SIGKILLed and restarted from the newest checkpoint: the resumed steps'
losses stay within RTOL of the uninterrupted run's, and both groups end with bitwise equal weights.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Dict

import pytest
import torch

from checkpoint.durable.discovery import Listing
from checkpoint.durable.manifest import MANIFEST, read_manifest
from checkpoint.interop.export import load_tensors
from metrics.records import read_metrics, step_losses
from support.launch import run_train
from support.processes import stop
from support.replicas import Group, lighthouse, overrides, start_in_order, wait_for

pytestmark = pytest.mark.distributed
RTOL = 1e-5  # as test_fault_tolerance.py: the sum over groups adds the gradients in another order
STEPS, INTERVAL = 50, 2  # room for group 0's restart (a few s) while group 1 goes on alone
SAVES = {"checkpoint.interval": INTERVAL, "checkpoint.async_mode": "async", "checkpoint.keep_last": STEPS,
         "+recovery.faults": "[{kind: slow, phase: step, step: -1, rank: -1, delay_s: 0.25}]"}
SAVE_DELAY = 8.0  # s the in-flight save is held up: room for the joining group's start and transfer


def writers(root: Path) -> Dict[int, int]:
    """step -> the replica group that wrote its committed checkpoint (its manifest records the writer's config)."""
    listing = Listing(root / "checkpoints")
    return {c.step: int(read_manifest(c.path).config["parallel"]["fault_tolerance"]["replica_id"])
            for c in listing.committed()}


@pytest.mark.rehearsal  # 30-60 s of three launches: .ci/run runs it after the suite, with the other rehearsals
def test_any_live_group_writes_the_durable_checkpoints_and_a_cold_restart_resumes(tmp_path, pydoc_data):
    baseline = tmp_path / "baseline"  # the uninterrupted run: one process, no fault tolerance
    run_train(overrides(baseline, pydoc_data, STEPS))
    expected = step_losses(baseline)

    root = tmp_path / "ft"
    root.mkdir()
    with lighthouse(tmp_path / "lighthouse.log") as address:
        first = Group(root, pydoc_data, STEPS, address, 0, extra=SAVES)
        second = Group(root, pydoc_data, STEPS, address, 1, extra=SAVES)
        try:
            start_in_order(first, second, together_at=3)
            first.send(signal.SIGKILL)  # group 0, the writer, from outside
            killed = time.time()
            assert first.proc.wait(30) == -signal.SIGKILL
            wait_for("two checkpoints of group 1 alone", lambda: len(
                [s for s, g in writers(root).items() if g == 1]) >= 2, [second])
            alone = writers(root)
            first.start()  # restarted: resumes from group 1's checkpoint, then takes the live state
            wait_for("a checkpoint of the restarted group 0", lambda: any(
                g == 0 and s > max(alone) for s, g in writers(root).items()), [first, second])
            stop(first.proc)  # every group lost: both SIGKILLed from outside
            stop(second.proc)
            newest = max(writers(root))
            start_in_order(first, second)  # group 0 from the newest checkpoint; group 1 takes its state
            first.finish()
            second.finish()
        finally:
            first.close()
            second.close()

    by_step = writers(root)
    outage = [r["step"] for r in second.rows() if r["committed"] and r["participants"] == 1 and r["started"] > killed
              and r["started"] < first.launches[1]]
    written_alone = sorted(s for s in outage if s % INTERVAL == 0 and s in by_step)
    assert len(written_alone) >= 2 and all(by_step[s] == 1 for s in written_alone), (outage, by_step)
    together = [r["step"] for r in first.rows() if r["committed"] and r["participants"] == 2]
    assert all(by_step[s] == 0 for s in together if s % INTERVAL == 0 and s in by_step), \
        f"group 0 writes whenever it is in the quorum: {by_step}"
    assert any(r["healed"] and r["started"] > first.launches[1] for r in first.rows()), "group 0 took the live state"
    text = "".join(Path(f).read_text() for f in sorted(root.glob("group_*.log")))
    assert "StaleWriter" not in text and "in use by a live run" not in text, text[-3000:]

    resumed = [r for r in first.rows() if r["committed"] and r["started"] > first.launches[2]]
    assert resumed[0]["step"] == newest + 1, f"the cold restart resumed from step {newest} (written by group " \
        f"{by_step[newest]})"
    logged = [r for group in (first, second) for r in read_metrics(group.run_dir)]  # every launch's every step
    assert {r["step"] for r in logged} == set(expected)
    worst = max(abs(r["loss"] - expected[r["step"]]) / abs(expected[r["step"]]) for r in logged)
    print(f"durable saves by any group: written by group 1 alone at steps {written_alone}, cold restart from step "
          f"{newest} (group {by_step[newest]}); max relative loss difference {worst:.2e}")
    assert worst <= RTOL
    (a,), (b,) = first.digests(), second.digests()
    assert a["step"] == b["step"] == STEPS and a["weights_sha256"] == b["weights_sha256"]


def checkpoint_tensors(path: Path) -> Dict[str, torch.Tensor]:
    """The model's and the optimizer's tensors of the committed checkpoint at ``path``, whole."""
    return {f"{prefix}{name}": t for prefix in ("model.", "optim.") for name, t in load_tensors(path, prefix).items()}


@pytest.mark.rehearsal  # its 8 s hold must outlast a group's start and transfer: too tight for a loaded suite
@pytest.mark.parametrize("alone", [1, 0])
def test_a_save_in_flight_while_a_joining_group_takes_the_live_state(tmp_path, pydoc_data, alone):
    """Group ``alone`` trains alone (so it writes the saves), saves step SAVED asynchronously, and its persist is
    held up (a slow fault at checkpoint_write, SAVE_DELAY s); the other group is started once that save is in
    flight and takes the live state (a later step) from it before the save commits. The save commits and holds
    exactly step SAVED's state (the uninterrupted run's checkpoint of that step, bitwise); the transfer gave the
    joining group the live state (every step after it has the same loss in both groups, both end with bitwise
    equal weights). With group 1 alone the writer changes while its save is in flight: group
    0, once in the quorum, writes step 2 x SAVED (on an idle machine it commits before group 1's older save does;
    under load the held save may commit first, so that order is printed, not asserted); with group 0
    alone the writer stays group 0, and the run ends before its next save (which would wait
    for this one, longer than the Lighthouse waits for a straggler before it forms a quorum without it)."""
    saved = 10
    steps = 24 if alone else 18
    saves = {"checkpoint.interval": saved, "checkpoint.async_mode": "async", "checkpoint.keep_last": 5,
             "checkpoint.save_final": "false"}
    baseline = tmp_path / "baseline"  # the uninterrupted run, saving the same steps
    run_train(overrides(baseline, pydoc_data, steps, saves))
    expected = step_losses(baseline)

    root = tmp_path / "ft"
    root.mkdir()
    faults = ("[{kind: slow, phase: step, step: -1, rank: -1, delay_s: 0.5}, "
              f"{{kind: slow, phase: checkpoint_write, step: {saved}, rank: -1, delay_s: {SAVE_DELAY}}}]")
    extra = {**saves, "+recovery.faults": faults}
    with lighthouse(tmp_path / "lighthouse.log") as address:
        first = Group(root, pydoc_data, steps, address, alone, extra=extra)
        second = Group(root, pydoc_data, steps, address, 1 - alone, extra=extra)
        try:
            first.start()
            wait_for(f"group {alone}'s save of step {saved} in flight", lambda: any(
                c.step == saved and not c.committed for c in Listing(root / "checkpoints").checkpoints()), [first])
            second.start()
            wait_for("the joining group's transfer", lambda: any(r["healed"] for r in second.rows()),
                     [first, second])
            first.finish()
            second.finish()
        finally:
            first.close()
            second.close()

    (healed,) = [r for r in second.rows() if r["healed"]]
    committed = {c.step: c for c in Listing(root / "checkpoints").committed()}
    written = {saved: alone, 2 * saved: 0} if alone else {saved: 0}  # each step's writer: its quorum's first group
    assert writers(root) == written
    at = {k: (Path(str(c.path)) / MANIFEST).stat().st_mtime for k, c in committed.items()}
    transferred_at = healed["started"] + healed["quorum_s"]
    print(f"save in flight during a transfer: group {1 - alone} took step {healed['step'] - 1}'s state "
          f"({healed['transfer_s']:.3f} s) {at[saved] - transferred_at:.2f} s before step {saved}'s save committed"
          + (f"; group 0's step {2 * saved} committed {at[saved] - at[2 * saved]:.2f} s before it" if alone else ""))
    assert healed["step"] - 1 > saved and transferred_at < at[saved], \
        f"the transfer (of step {healed['step'] - 1}, done at {transferred_at:.2f}) came while the save of step " \
        f"{saved} was in flight (committed at {at[saved]:.2f})"
    ours = checkpoint_tensors(Path(str(committed[saved].path)))
    (reference,) = [c for c in Listing(baseline / "checkpoints").committed() if c.step == saved]
    theirs = checkpoint_tensors(Path(str(reference.path)))
    differ = [k for k in ours if not torch.equal(ours[k], theirs.get(k))]
    assert ours.keys() == theirs.keys() and not differ, f"the checkpoint holds step {saved}'s state: {differ}"

    losses = [{r["step"]: r["loss"] for r in read_metrics(group.run_dir)} for group in (first, second)]
    after = [k for k in losses[1] if k >= healed["step"]]
    assert after and all(losses[0][k] == losses[1][k] for k in after), "both groups' state is the same after it"
    worst = max(abs(losses[0][k] - expected[k]) / abs(expected[k]) for k in expected)
    assert worst <= RTOL, worst
    (a,), (b,) = first.digests(), second.digests()
    assert a["step"] == b["step"] == steps and a["weights_sha256"] == b["weights_sha256"]


def test_groups_preempted_together_save_each_step_once(tmp_path, pydoc_data):
    """A second launch of a running group into the shared folder is refused (each group's own lease). Then
    SIGTERM to both groups at once (a job-wide preemption): each group stops at a step boundary and the
    preemption save is written by that step's writer alone; the other group, whose state is the same, leaves
    without saving. No step is saved twice (two saves of one step would race for its folder)."""
    extra = {"checkpoint.interval": 1000, "checkpoint.save_final": "false", **{"+recovery.faults": SAVES[
        "+recovery.faults"]}}
    root = tmp_path / "ft"
    root.mkdir()
    with lighthouse(tmp_path / "lighthouse.log") as address:
        groups = [Group(root, pydoc_data, STEPS, address, g, extra=extra) for g in (0, 1)]
        try:
            start_in_order(*groups, together_at=3)
            duplicate = Group(root, pydoc_data, STEPS, address, 1, extra=extra)  # group 1 launched twice
            duplicate.index = "1-again"  # its own log file
            code = duplicate.start().proc.wait(60)
            duplicate.close()
            assert code != 0 and "checkpoint.dir: " in duplicate.text() and \
                "is in use by a live run" in duplicate.text(), f"{code}: {duplicate.text()}"
            for group in groups:
                group.send(signal.SIGTERM)
            for group in groups:
                group.finish(60)  # preempted: a clean exit
        finally:
            for group in groups:
                group.close()
    folders = [c.checkpoint_id for c in Listing(root / "checkpoints").checkpoints()]
    by_step = writers(root)
    last = {g: max(r["step"] for r in group.rows() if r["committed"]) for g, group in enumerate(groups)}
    assert len(folders) == len(by_step) >= 1, f"each step saved once: {folders}"
    for step, writer in by_step.items():  # the writer of each step is the first group of its quorum
        rows = [r for r in groups[writer].rows() if r["step"] == step and r["committed"]]
        assert rows and rows[-1]["index"] == 0, (step, writer, rows)
    assert max(by_step) == max(last.values()), f"the newest step is saved: {by_step}, last steps {last}"
