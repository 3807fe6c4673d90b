"""The house rules a forker relies on: imports point one way, nothing imports train.py, config
checks run without torch, and a training run never imports the rehearsal tooling."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from support.launch import run, worker

ROOT = Path(__file__).resolve().parents[2]

# Lower layers never import higher ones; a package may import itself and anything below it.
LAYERS = {
    # the vocabulary: valid choices, defaults, ConfigError, the bounds of every number
    "configs.constants": 0, "configs.checks": 0, "configs.bounds": 0,
    "parallel.collectives": 0,  # every product collective (torch only): any package may agree through it
    "model": 1, "data": 1,
    "configs.schema": 2, "parallel": 2, "training": 2, "metrics": 2,
    "checkpoint": 3,
    "recovery": 4,
    "trainer": 5,  # the recipe and the config checks of every section gathered
    "planner": 6, "rehearsal": 6,  # estimates and the rehearsal kit: what a run never imports
}
PACKAGES = ("configs", "model", "data", "parallel", "training", "metrics", "checkpoint", "recovery", "trainer",
            "planner", "rehearsal")
# Inside checkpoint/ the same rule, one level down: what a checkpoint holds and where it is stored, then
# the durable tier, then the memory tier and the weights in and out, then the facade and the modules beside it.
CHECKPOINT_LAYERS = {"checkpoint.state": 0, "checkpoint.storage": 0, "checkpoint.durable": 1, "checkpoint.memory": 2,
                     "checkpoint.interop": 2,
                     "checkpoint": 3}


def _unit(module: str) -> str:
    """The layer unit of a dotted module name: its top package, or configs.<module> for configs/."""
    parts = module.split(".")
    if parts[0] == "configs":
        return "configs.schema" if len(parts) == 1 or parts[1] == "__init__" else ".".join(parts[:2])
    if parts[:2] == ["parallel", "collectives"]:
        return "parallel.collectives"
    return parts[0]


def _checkpoint_unit(module: str) -> str:
    """checkpoint.<sub-package> for a module of one, else checkpoint (the facade and its neighbours)."""
    parts = module.split(".")
    unit = ".".join(parts[:2])
    return unit if unit in CHECKPOINT_LAYERS else "checkpoint"


def _project_imports(path: Path):
    """(line, imported project module) for every import in ``path``, nested ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            folder = ROOT.joinpath(*node.module.split("."))  # "from parallel import collectives": a module
            names = [f"{node.module}.{a.name}" if (folder / f"{a.name}.py").exists() else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES or name.split(".")[0] == "train":
                yield node.lineno, name


def _python_files():
    files = [ROOT / "train.py"]
    for pkg in PACKAGES:
        files += sorted((ROOT / pkg).rglob("*.py"))
    files += sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    return files


def test_imports_point_down():
    wrong = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            me = _unit(".".join(path.relative_to(ROOT).with_suffix("").parts))
            for line, name in _project_imports(path):
                them = _unit(name)
                if them == me:
                    continue
                if them == "train" or LAYERS[them] >= LAYERS[me]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {me} (layer {LAYERS[me]}) imports {name} "
                                 f"(layer {LAYERS.get(them, 'top')})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_checkpoint_sub_packages_import_down():
    wrong = []
    for path in sorted((ROOT / "checkpoint").rglob("*.py")):
        me = _checkpoint_unit(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for line, name in _project_imports(path):
            if name.split(".")[0] != "checkpoint":
                continue
            them = _checkpoint_unit(name)
            if them != me and CHECKPOINT_LAYERS[them] >= CHECKPOINT_LAYERS[me]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {me} imports {name}")
    assert not wrong, "imports inside checkpoint/ that point up or sideways:\n" + "\n".join(wrong)


def test_nothing_imports_train_py():
    found = [f"{p.relative_to(ROOT)}:{line}" for p in _python_files() if p.name != "train.py"
             for line, name in _project_imports(p) if name.split(".")[0] == "train"]
    assert found == []


def test_config_checks_do_not_import_torch_and_a_run_does_not_import_tools():
    proc = run([sys.executable, worker("import_boundaries")], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
