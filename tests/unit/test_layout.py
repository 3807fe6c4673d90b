"""The house rules a forker relies on: imports point one way (inside checkpoint/ and data/ too),
nothing imports train.py, config checks run without torch, and a training run never imports the
rehearsal tooling nor the offline data preparation."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

from support.launch import run, worker

ROOT = Path(__file__).resolve().parents[2]

# Lower layers never import higher ones; a package may import itself and anything below it.
LAYERS = {
    "configs": 0,  # how a key is declared (configs/keys.py) and the YAML: every layer may declare keys
    "parallel.collectives": 0,  # every product collective (torch only): any package may agree through it
    "model": 1,
    "parallel": 2,
    "data": 3,
    "training": 4, "metrics": 4,
    "checkpoint": 5,
    "recovery": 6,
    "trainer": 7,  # the recipe, the typed config of every section, the pre-flight
    "planner": 8, "rehearsal": 8,  # estimates and the rehearsal kit: what a run never imports
}
PACKAGES = ("configs", "model", "data", "parallel", "training", "metrics", "checkpoint", "recovery", "trainer",
            "planner", "rehearsal")
# Inside checkpoint/ the same rule, one level down: the keys (every sub-package's config module), then what
# a checkpoint holds and where it is stored, then the durable tier, then the memory tier and the weights in
# and out, then the facade and the modules beside it.
CHECKPOINT_LAYERS = {"checkpoint.config": 0, "checkpoint.state": 1, "checkpoint.storage": 1,
                     "checkpoint.durable": 2, "checkpoint.memory": 3, "checkpoint.interop": 3,
                     "checkpoint": 4}
# Inside data/: the error and the prepare command, and the tokenizers a run reads; the formats (the shard
# contract, one module per format, the registry); the runtime pipeline at the top of data/; the offline
# preparation above it all, which a run never imports (it runs scripts/prepare_data.py in a process of its own).
DATA_LAYERS = {"data.prepared": 0, "data.tokenizer": 0, "data.formats": 1, "data": 2, "data.prep": 3}


def _unit(module: str) -> str:
    """The layer unit of a dotted module name: its top package, or parallel.collectives."""
    parts = module.split(".")
    if parts[:2] == ["parallel", "collectives"]:
        return "parallel.collectives"
    return parts[0]


def _checkpoint_unit(module: str) -> str:
    """checkpoint.<sub-package> for a module of one, else checkpoint (the facade and its neighbours); a config
    module (the torch-free declaration of a sub-package's keys) is one unit with checkpoint/config.py."""
    parts = module.split(".")
    if parts[-1] == "config":
        return "checkpoint.config"
    unit = ".".join(parts[:2])
    return unit if unit in CHECKPOINT_LAYERS else "checkpoint"


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the tests of this file (they read every module)."""
    return ast.parse(path.read_text(), filename=str(path))


@functools.lru_cache(maxsize=None)
def _project_imports(path: Path) -> tuple:
    """(line, imported project module) for every import in ``path``, nested ones included."""
    return tuple(_imports_of(path))


def _imports_of(path: Path):
    for node in ast.walk(_tree(path)):
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


def test_data_sub_packages_import_down():
    def unit(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if ".".join(parts[:2]) in DATA_LAYERS else "data"

    wrong = []
    for path in sorted((ROOT / "data").rglob("*.py")):
        me = unit(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for line, name in _project_imports(path):
            them = unit(name) if name.split(".")[0] == "data" else None
            if them not in (None, me) and DATA_LAYERS[them] >= DATA_LAYERS[me]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {me} imports {name}")
    assert not wrong, "imports inside data/ that point up or sideways:\n" + "\n".join(wrong)


def test_nothing_imports_train_py():
    found = [f"{p.relative_to(ROOT)}:{line}" for p in _python_files() if p.name != "train.py"
             for line, name in _project_imports(p) if name.split(".")[0] == "train"]
    assert found == []


def test_config_checks_do_not_import_torch_and_a_run_does_not_import_tools():
    proc = run([sys.executable, worker("import_boundaries")], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ---- the seams: what only one place may know ----

PRODUCT = ("configs", "model", "parallel", "data", "training", "metrics", "checkpoint", "recovery", "trainer")


def _product_files(outside: str = ""):
    """train.py and every module of the product, but those under ``outside`` (a folder of the repository)."""
    files = [ROOT / "train.py"] + [p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))]
    return [p for p in files if not (outside and p.relative_to(ROOT).as_posix().startswith(outside + "/"))]


def _strings(tree: ast.AST):
    """(line, value) of every string constant that is code, not a docstring or a comment."""
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_code_outside_the_storage_package_asks_which_store_it_has():
    """Storage is one interface (checkpoint/storage/): nothing else imports a backend's module (but for the
    sub-section of its settings), tests an object against a store class, or asks
    whether it is on an object store; a new backend is one file there."""
    import checkpoint.storage as storage
    from checkpoint.storage.base import Store

    classes = [*map(storage.backend, storage.STORES), type(storage.location("/x").store)]
    backends, modules = {cls.__name__ for cls in classes}, {cls.__module__ for cls in classes}
    assert issubclass(storage.backend("s3://"), Store) and "PosixStore" in backends
    found = []
    for path in _product_files(outside="checkpoint/storage"):
        tree = _tree(path)
        where = path.relative_to(ROOT)
        for line, name in _project_imports(path):
            if name in modules or name.startswith(tuple(m + "." for m in modules)):
                found.append(f"{where}:{line}: imports the backend module {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in backends | {"on_object_store"}:
                found.append(f"{where}:{node.lineno}: names {node.id}")
            if isinstance(node, ast.Attribute) and node.attr in backends | {"on_object_store"}:
                found.append(f"{where}:{node.lineno}: names {node.attr}")
        found += [f"{where}:{line}: tests a class name {value!r}" for line, value in _strings(tree)
                  if value in backends]
    assert not found, "code outside checkpoint/storage/ that knows which store it has:\n" + "\n".join(found)


def test_the_mesh_axes_are_named_in_parallel_only():
    """The mesh's axis names are declared once (parallel/dims.py MESH_DIM_NAMES; the config's keys are the
    parallel section's fields): no other code spells them as strings (a manifest's layout, a sub-mesh)."""
    from parallel.dims import MESH_DIM_NAMES

    found = [f"{p.relative_to(ROOT)}:{line}: {value!r}" for p in _product_files(outside="parallel")
             for line, value in _strings(_tree(p)) if value in MESH_DIM_NAMES]
    assert not found, "mesh axes spelled outside parallel/ (use parallel.dims):\n" + "\n".join(found)


def layer_diagram() -> str:
    """The layer table as docs/architecture.md draws it: the top layer first, one line a layer."""
    layers = {}
    for unit, layer in LAYERS.items():
        layers.setdefault(layer, []).append(unit + ("" if "." in unit else "/"))
    return "\n".join(f"{layer}  {'  '.join(units)}" for layer, units in sorted(layers.items(), reverse=True))


def test_the_architecture_diagram_is_the_layer_table():
    """docs/architecture.md's diagram is this file's LAYERS, drawn by layer_diagram: the two cannot disagree."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    marker = "<!-- drawn from LAYERS in tests/unit/test_layout.py by layer_diagram(); a test compares them -->"
    assert marker in text, f"docs/architecture.md lacks the layer diagram's marker: {marker}"
    block = text.split(marker, 1)[1].split("```", 2)[1].strip("\n")
    assert block == layer_diagram(), f"redraw docs/architecture.md's diagram:\n{layer_diagram()}"


def test_each_bound_is_declared_with_its_key():
    """What a number of the config may be is declared once, with the key (``key(default, meaning, bound)`` in
    the section's config.py): no other module of the product builds a Bound or uses one of configs/keys.py's."""
    import configs.keys as keys

    vocabulary = {"Bound"} | {name for name, value in vars(keys).items() if isinstance(value, keys.Bound)}
    found = []
    for path in _product_files():
        if path.name == "config.py" or path == ROOT / "configs" / "keys.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Name) and node.id in vocabulary:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.id}")
    assert not found, "bounds declared away from their keys:\n" + "\n".join(found)


def test_no_project_import_inside_a_function_but_where_a_unit_plugs_in():
    """An import of the project's own code sits at the top of its module, where the layer rules see it and no
    cycle can hide. The exceptions are named: an optional unit's code, imported inside the statement that turns
    it on (marked ``# unit: NAME``), so that a run which does not use it does not load it; and the planner,
    which train.py's dry run alone prints."""
    found = []
    for path in _product_files():
        lines = path.read_text().splitlines()
        tree = _tree(path)
        marked = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and "# unit: " in lines[n.lineno - 1]]
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                ours = [n for n in names if n.split(".")[0] in PACKAGES]
                in_unit = any(m.lineno <= node.lineno <= m.end_lineno for m in marked)
                planner = path.name == "train.py" and fn.name == "dry_run" and ours == ["planner.plan"]
                if ours and not (in_unit or planner):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {fn.name} imports {ours}")
    assert not found, "imports of the project inside functions:\n" + "\n".join(found)
