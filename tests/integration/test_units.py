"""Optional features are units: each lives in its own files and plugs into the rest at marked statements (a
statement whose first line carries ``# unit: NAME``). A fork that deletes a unit's files and its marked
statements still has a trainer that trains, saves and resumes bitwise, and the unit's keys are gone from the
config. Each unit is deleted in turn from a copy of the tree, which must then refer to it nowhere and refuse its keys;
then a copy without every unit is killed after its first save and started again, and its losses equal the whole
tree's, step for step."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from metrics.records import read_metrics, step_losses
from rehearsal.chains import faults_override
from rehearsal.runs import tiny_overrides
from support.launch import ROOT, run_train, subprocess_env

pytestmark = pytest.mark.distributed  # starts train.py processes

# unit -> (its files, a key of the unit's that the config then refuses, the message)
UNITS = {
    "memory": (["checkpoint/memory"], "checkpoint.memory.interval=2", "checkpoint.memory"),
    "s3": (["checkpoint/storage/s3"], "checkpoint.s3.region=us-east-1", "checkpoint.s3"),
    "raw": (["checkpoint/durable/raw.py"], "checkpoint.format=raw", "checkpoint.format='raw': choose one of ['dcp']"),
    "interop": (["checkpoint/interop", "model/hf.py"], "model.init_from=/weights", "model.init_from"),
    "guards": (["recovery/guards"], "recovery.guards.enabled=false", "recovery.guards"),
    "fault_tolerance": (["recovery/fault_tolerance.py", "parallel/fault_tolerance"],
                        "parallel.fault_tolerance.enabled=true", "parallel.fault_tolerance"),
}
COPIED = ("configs", "model", "parallel", "data", "training", "metrics", "checkpoint", "recovery", "trainer",
          "scripts", "train.py")
MARK = re.compile(r"#.*\bunit: (\w+)")
STEPS, INTERVAL, KILL_AT = 4, 2, 3


def _marked(tree: ast.AST, lines, unit: str):
    """The statements whose first line marks them as ``unit``'s (outermost only)."""
    found = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)
             and (m := MARK.search(lines[n.lineno - 1])) and m.group(1) == unit]
    return [n for n in found if not any(o is not n and o.lineno <= n.lineno and n.end_lineno <= o.end_lineno
                                        for o in found)]


def remove_unit(tree_root: Path, unit: str) -> int:
    """Delete ``unit``'s files and its marked statements under ``tree_root``; the statements removed."""
    for path in UNITS[unit][0]:
        target = tree_root / path
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    removed = 0
    for path in tree_root.rglob("*.py"):
        text = path.read_text()
        if f"unit: {unit}" not in text:
            continue
        lines = text.splitlines(keepends=True)
        for node in sorted(_marked(ast.parse(text), lines, unit), key=lambda n: -n.lineno):
            del lines[node.lineno - 1:node.end_lineno]
            removed += 1
        path.write_text("".join(lines))
    return removed


def _modules(unit: str):
    return [p.removesuffix(".py").replace("/", ".") for p in UNITS[unit][0]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, pydoc_data):
    """The whole tree's losses: the same run, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    run_train(tiny_overrides(run_dir, pydoc_data, STEPS, INTERVAL, async_mode="sync"))
    return step_losses(run_dir)


def _tree(tmp_path: Path, *units: str) -> Path:
    """A copy of the tree without ``units``, checked to name none of them and import none of their modules."""
    tree = tmp_path / "tree"
    for name in COPIED:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name, tree / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                         if (ROOT / name).is_dir() else {}))
    for unit in units:
        assert remove_unit(tree, unit) >= 2, f"{unit} plugs in nowhere"
    gone = tuple(m for unit in units for m in _modules(unit))
    product = [p for p in tree.rglob("*.py") if p.relative_to(tree).parts[0] != "scripts"]  # scripts may use it
    for path in product:  # nothing left that names a unit or imports its modules, at any depth of the file
        text = path.read_text()
        assert not [u for u in units if f"unit: {u}" in text], path
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] \
                if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith(gone)], (path, names)
    return tree


def _train(tree: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(tree / "train.py"), *overrides], cwd=tree,
                          env=subprocess_env({"PYTHONPATH": str(tree)}), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_a_tree_without_the_unit_imports_none_of_it_and_refuses_its_keys(tmp_path, pydoc_data, unit):
    """Each unit alone: deleted, nothing left refers to it (imports inside functions included), and its key is
    refused by the copy's own validation with the message a user reads."""
    tree = _tree(tmp_path, unit)
    key, said = UNITS[unit][1:]
    refused = _train(tree, *tiny_overrides(tmp_path / "run", pydoc_data, STEPS, INTERVAL, async_mode="sync"), key,
                     "check_only=true")
    assert refused.returncode == 2 and said in refused.stderr, refused.stderr[-3000:]


def test_a_tree_without_every_unit_trains_saves_and_resumes_bitwise(tmp_path, pydoc_data, reference):
    """Every unit deleted at once (the test above shows that none leans on another): the copy is killed after its
    first save and started again, and its losses equal the whole tree's, step for step."""
    tree = _tree(tmp_path, *UNITS)
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(run_dir, pydoc_data, STEPS, INTERVAL, async_mode="sync",
                               extra=[faults_override([{"kind": "sigkill", "phase": "step", "step": KILL_AT}])])
    killed = _train(tree, *overrides)
    assert killed.returncode != 0 and "Traceback" not in killed.stderr, killed.stderr[-3000:]
    resumed = _train(tree, *overrides)  # the fault fired once: this run resumes from the step-2 save
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [resume] = read_metrics(run_dir, "resume")
    assert resume["checkpoint_id"] == f"step_{INTERVAL:08d}"
    assert step_losses(run_dir) == reference  # every step, bitwise
