"""Verified resume: every corruption kind is detected and recovered from by falling back to
the previous committed checkpoint; a chain of bad checkpoints ends in a clear error, and a
restart after it refuses to start from scratch instead of looping.

All scenarios run in one driver process (python -m rehearsal.supervisor), which forks each
attempt from a warm parent. Saves are synchronous here so that "corrupt the checkpoint of
step 4, then SIGKILL at step 5" is deterministic.
"""

from __future__ import annotations

import json
import sys

import pytest

from metrics.records import read_metrics, step_losses
from rehearsal.chains import divergences, faults_override
from rehearsal.runs import tiny_overrides
from support.launch import run, worker

pytestmark = pytest.mark.distributed  # one supervisor process forks every training attempt

STEPS = 8
CORRUPTIONS = ("truncate", "flip_byte", "delete_file", "delete_manifest")


def _scenarios(root, data):
    def run(name, faults, max_restarts, extra=()):
        extra = list(extra) + ([faults_override(faults)] if faults else [])
        return {"name": name, "max_restarts": max_restarts,
                "overrides": tiny_overrides(root / name, data, STEPS, 2, keep_last=3, async_mode="sync", extra=extra)}

    kill5 = {"kind": "sigkill", "phase": "step", "step": 5}
    out = [run("baseline", [], 0)]
    for how in CORRUPTIONS:
        out.append(run(how, [{"kind": "corrupt", "phase": "checkpoint_committed", "step": 4, "corruption": how},
                             kill5], 2))
    # weights intact, but they do not reproduce the stored probe loss: only verification sees it
    out.append(run("probe", [kill5], 2))
    bad2 = {"kind": "corrupt", "phase": "checkpoint_committed", "step": 2, "corruption": "flip_byte"}
    bad4 = {"kind": "corrupt", "phase": "checkpoint_committed", "step": 4, "corruption": "truncate"}
    out.append(run("all_bad", [bad2, bad4, kill5], 2))
    bad6 = {"kind": "corrupt", "phase": "checkpoint_committed", "step": 6, "corruption": "flip_byte"}
    out.append(run("bounded", [bad4, bad6, {"kind": "sigkill", "phase": "step", "step": 7}], 1,
                   extra=["recovery.max_fallbacks=1"]))
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory, pydoc_data):
    root = tmp_path_factory.mktemp("fallback")
    spec = _scenarios(root, pydoc_data)
    # the probe scenario: after step 4 commits, its stored probe loss is rewritten (checksums stay
    # valid) by the driver's hook (tests/support/workers/supervisor_probe.py)
    spec_path, out = root / "spec.json", root / "results.json"
    spec_path.write_text(json.dumps(spec))
    proc = run([sys.executable, worker("supervisor_probe"), str(spec_path), str(out)], timeout=900)
    assert out.exists() and proc.returncode == 0, proc.stderr[-5000:]
    return root, json.loads(out.read_text())


def _codes(results, name):
    return [a["returncode"] for a in results[name]["attempts"]]


@pytest.mark.parametrize("how", CORRUPTIONS + ("probe",))
def test_corruption_is_detected_and_recovered_by_fallback(scenarios, how):
    root, results = scenarios
    assert _codes(results, how) == [-9, 0]
    log = (root / f"{how}.log").read_text()
    resumed = read_metrics(root / how, "resume")
    assert [e["checkpoint_id"] for e in resumed] == ["step_00000002"]  # step 4 was not used
    assert resumed[0]["load_s"] > 0  # timed across the failed attempt and the fallback
    # the re-run saves step 4 again; the old directory is moved aside (step_00000004.replaced-*)
    marks = list((root / how / "checkpoints").glob("step_00000004*/BAD"))
    if how == "delete_manifest":
        # without a manifest the directory never counts as committed: resume skips it outright
        assert not marks and resumed[0]["skipped"] == []
    else:
        assert resumed[0]["skipped"] == ["step_00000004"] and len(marks) == 1
        reason = marks[0].read_text()
        assert ("probe loss" in reason) if how == "probe" else ("failed verification" in reason)
        assert "falling back from step_00000004 to step_00000002" in log
    assert divergences(step_losses(root / "baseline"), root / how) == []  # and it trains on exactly


def test_chain_of_bad_checkpoints_ends_in_a_clear_error_not_a_loop(scenarios):
    root, results = scenarios
    assert _codes(results, "all_bad") == [-9, 1, 1]  # the launcher's restarts do not help, and do not loop
    log = (root / "all_bad.log").read_text()
    assert "no usable checkpoint left" in log
    assert "every committed checkpoint" in log and "Refusing to start from scratch" in log
    steps_logged = [r["step"] for r in
                    map(json.loads, (root / "all_bad" / "metrics.jsonl").read_text().splitlines()) if "kind" not in r]
    assert steps_logged == [1, 2, 3, 4]  # never silently restarted from step 1


def test_fallbacks_are_bounded(scenarios):
    root, results = scenarios
    assert _codes(results, "bounded") == [-9, 1]
    log = (root / "bounded.log").read_text()
    assert "recovery.max_fallbacks=1" in log and "verified resume gave up" in log
