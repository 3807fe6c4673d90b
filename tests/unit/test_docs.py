"""The documentation is true to the tree: README.md and docs/*.md are scanned for

  (a) repository paths (``scripts/plan.py``, ``configs/experiment/debug.yaml``, ``docs/guards.md``,
      ``checkpoint/manager.py``, ``tests/unit/test_data_*.py``, bare ``NAME.md``): each must exist;
  (b) config keys in backticks (``recovery.guards.action``, ``checkpoint.*``, ``optim.schedule=constant``):
      each must be a field of the schema (trainer/config.py), a Hydra group choice (``+experiment=debug``,
      ``model=8b``: a file in configs/<group>/) or a Python name (``checkpoint.durable.reader.RawFileReader``);
      and every command that runs train.py (or a script that passes Hydra overrides through) must
      compose and pass ``validate_config`` with exactly the overrides written;
  (c) every ``python -m X``: X is a module that can run as a program, and the command names only
      options its argparse parser defines, including the required ones.

and the docstrings of the code (modules, classes, functions) are held to (a) as well: every
repository path they name exists, and every bare name of a code or doc file (``saver.py``,
``guards.md``) is a file of the tree.

Nothing here imports torch: the schema, the config checks and Hydra are torch-free. Every problem
is reported as ``file:line: reference: why``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import shlex
import typing
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Set

from hydra import compose, initialize_config_dir

from trainer.config import Config, register
from trainer.preflight import validate_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

# First path segments that name something in this repository.
TOP_DIRS = (".ci", ".github", "checkpoint", "configs", "data", "docs", "metrics", "model", "parallel",
            "planner", "recovery", "rehearsal", "scripts", "tests", "trainer", "training")
# Files a reader is told to create (git-ignored), so they are not in the tree.
CREATED_BY_READER = {"configs/local/default.yaml"}
# Dotted names that are keys inside a checkpoint (docs/checkpoint-format.md), not config keys.
CHECKPOINT_KEYS = {"optim.param_groups"}
# The schema's sections (model, parallel, data, training, ...): what a dotted config key starts with.
CONFIG_SECTIONS = tuple(name for name, tp in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(tp))
# Programs whose arguments after the script are Hydra overrides.
HYDRA_PROGRAMS = ("train.py", "scripts/plan.py", "scripts/launch_single_node.sh", "scripts/launch_multi_node.sh",
                  "scripts/train.sbatch")

PATH_RE = re.compile(r"(?<![\w./<>$*{@~-])((?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[\w./*-]*)")
BARE_MD_RE = re.compile(r"(?<![\w./<>-])([A-Za-z][\w-]*\.md)\b")
FENCE_RE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)  # also indented, inside a list item
INLINE_RE = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")  # may wrap onto the next line, not across a paragraph
KEY_RE = re.compile(r"(?<![\w./<>$-])(\+{0,2})(" + "|".join(CONFIG_SECTIONS) + r")((?:\.(?:\w+|\*))+)")
ASSIGN_RE = re.compile(r"^(\+{0,2})(\w+)=(\S+)$")
PLACEHOLDER_RE = re.compile(r"^[A-Z][A-Z_]*$|<[^>]*>|\$")


class Snippet(NamedTuple):
    doc: Path
    line: int
    text: str  # one inline code span, or one line of a fenced block


def where(doc: Path, line: int) -> str:
    return f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc}:{line}"


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def snippets(doc: Path, text: str) -> Iterator[Snippet]:
    """Inline code spans, and the lines of fenced blocks (backslash continuations joined)."""
    fenced_spans = []
    for m in FENCE_RE.finditer(text):
        fenced_spans.append(m.span())
        first = line_of(text, m.start(1))
        pending, start = "", first
        for i, raw in enumerate(m.group(1).splitlines()):
            if not pending:
                start = first + i
            if raw.rstrip().endswith("\\"):
                pending += raw.strip()[:-1] + " "
                continue
            yield Snippet(doc, start, pending + raw.strip())
            pending = ""
    outside = list(text)
    for a, b in fenced_spans:  # blank the fences (keeping newlines) so inline spans cannot pair across them
        outside[a:b] = [c if c == "\n" else " " for c in text[a:b]]
    prose = "".join(outside)
    for m in INLINE_RE.finditer(prose):
        yield Snippet(doc, line_of(prose, m.start()), " ".join(m.group(1).split()))


# -- (a) paths ---------------------------------------------------------------------------------------
def code_spans(text: str) -> List[tuple]:
    spans = [m.span() for m in FENCE_RE.finditer(text)]
    return spans + [m.span() for m in INLINE_RE.finditer(text)]


def path_problems(doc: Path, text: str) -> List[str]:
    """Paths anywhere in the text; in prose, a name without an extension or a trailing "/" (and/or)
    is a word, not a path, unless it is in code."""
    out = []
    spans = code_spans(text)
    for m in PATH_RE.finditer(text):
        ref = m.group(1).rstrip(".,:;)")
        if ref in CREATED_BY_READER or any(PLACEHOLDER_RE.fullmatch(part) for part in ref.split("/")):
            continue
        in_code = any(a <= m.start(1) < b for a, b in spans)
        if not in_code and not ref.endswith("/") and "." not in ref.rsplit("/", 1)[-1]:
            continue
        if "*" in ref:
            ok = any(ROOT.glob(ref))
        elif ref.endswith("/"):
            ok = (ROOT / ref).is_dir()
        else:
            ok = (ROOT / ref).exists()
        if not ok:
            out.append(f"{where(doc, line_of(text, m.start(1)))}: {ref}: no such file or folder in the repository")
    for m in re.finditer(r"\.\./shared/\S*", text):  # the developers' notes are not shipped with a fork
        out.append(f"{where(doc, line_of(text, m.start()))}: {m.group(0).rstrip('.,:;)`')}: points outside the "
                   "repository; write the fact here in the docs' own words")
    for m in BARE_MD_RE.finditer(text):
        name = m.group(1)
        if not any((base / name).exists() for base in (ROOT, ROOT / "docs", doc.parent)):
            out.append(f"{where(doc, line_of(text, m.start(1)))}: {name}: not a file of the repository")
    return out


# -- (b) config keys ---------------------------------------------------------------------------------
def _unwrap_optional(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def schema_has(parts: List[str]) -> bool:
    """``parts`` (``["recovery", "guards", "action"]``, ``*`` for any field) is a key of the schema."""
    tp = Config
    for i, part in enumerate(parts):
        tp = _unwrap_optional(tp)
        if typing.get_origin(tp) in (dict, Dict):  # a mapping (recovery.timeouts): any key
            return True
        if not dataclasses.is_dataclass(tp):
            return False
        if part == "*":
            return i == len(parts) - 1
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return False
        tp = hints[part]
    return True


def config_groups() -> Set[str]:
    return {p.name for p in (ROOT / "configs").iterdir() if p.is_dir() and any(p.glob("*.yaml"))} | {"experiment"}


def _module_file(parts: List[str]) -> Optional[Path]:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> Set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def python_name_exists(dotted: str) -> bool:
    """``checkpoint.durable.reader.RawFileReader``: a module of this repository and a name it defines."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        return not rest or rest[0] in _top_level_names(module)
    return False


def key_problem(key: str, value: Optional[str]) -> Optional[str]:
    """Why ``key`` (optionally ``key=value``) is not a config key or group choice; None if it is."""
    parts = key.split(".")
    if parts[0] == "hydra":
        return None
    if len(parts) == 1 and parts[0] in config_groups():
        if value is None or PLACEHOLDER_RE.search(value):
            return None
        return None if (ROOT / "configs" / parts[0] / f"{value}.yaml").is_file() else \
            f"no configs/{parts[0]}/{value}.yaml"
    if schema_has(parts) or (value is None and (python_name_exists(key) or key in CHECKPOINT_KEYS)):
        return None
    return "not a config key (configs/schema.py), a config group or a Python name of the repository"


def key_problems(snippet: Snippet) -> List[str]:
    out = []
    text = snippet.text
    if is_command(text):
        return out  # commands are composed whole (test_commands_compose)
    for m in KEY_RE.finditer(text):
        key, after = m.group(2) + m.group(3), text[m.end():]
        if after.startswith(("(", "[", ".<", "<")):  # a call, an index, a checkpoint key pattern: Python
            continue
        value = after[1:].split()[0] if after.startswith("=") and after[1:].split() else None
        why = key_problem(key, value)
        if why:
            out.append(f"{where(snippet.doc, snippet.line)}: `{key}`: {why}")
    m = ASSIGN_RE.match(text.strip())
    if m and "." not in m.group(2):  # `dry_run=true`, `+experiment=70b`, `model=8b`
        why = key_problem(m.group(2), m.group(3))
        if why:
            out.append(f"{where(snippet.doc, snippet.line)}: `{text.strip()}`: {why}")
    return out


# -- commands ----------------------------------------------------------------------------------------
def is_command(text: str) -> bool:
    return bool(re.search(r"(^|\s|/)(python3?|torchrun|sbatch)(\s|$)|(^|\s)(\S*/)?train\.py(\s|$)|"
                          r"(^|\s)\S*scripts/\S+\.(py|sh|sbatch)\b", text))


def split_command(text: str) -> Optional[List[str]]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return None


def program_of(tokens: List[str]) -> tuple:
    """(program, its arguments): a script path, ``-m module``, or (None, [])."""
    for i, tok in enumerate(tokens):
        if re.fullmatch(r"(\S*/)?python3?", tok) and tokens[i + 1:i + 2] == ["-m"]:
            return ("-m " + tokens[i + 2], tokens[i + 3:]) if i + 2 < len(tokens) else (None, [])
        clean = tok[2:] if tok.startswith("./") else tok
        if clean == "train.py" or clean.endswith("/train.py") or re.fullmatch(r"scripts/\S+\.(py|sh|sbatch)", clean):
            return ("train.py" if clean.endswith("train.py") else clean), tokens[i + 1:]
    return None, []


def argparse_options(path: Path) -> Optional[tuple]:
    """(every option string, the required ones) of the argparse parser built in ``path``; None if none."""
    options, required = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                     and a.value.startswith("-")]
            options |= set(flags)
            if flags and any(k.arg == "required" and isinstance(k.value, ast.Constant) and k.value.value is True
                             for k in node.keywords):
                required.add(flags[-1])
    return (options, required) if options else None


def module_runnable(name: str) -> Optional[str]:
    """Why ``python -m name`` cannot run; None if it can. Looks at files only (imports nothing)."""
    parts = name.split(".")
    if (ROOT / parts[0]).is_dir():
        path = _module_file(parts)
        if path is None:
            return "no such module in the repository"
        if path.name == "__init__.py":
            return None if (path.parent / "__main__.py").is_file() else "a package without __main__.py"
        return None if "__main__" in path.read_text() else "the module has no `if __name__ == \"__main__\"`"
    spec = importlib.util.find_spec(parts[0])  # a top-level name: found without importing it
    if spec is None:
        return "not installed"
    locations = list(spec.submodule_search_locations or [])
    for part in parts[1:]:
        found = [Path(loc) / part for loc in locations if (Path(loc) / part).is_dir()]
        files = [Path(loc) / f"{part}.py" for loc in locations if (Path(loc) / f"{part}.py").is_file()]
        if not found and not files:
            return "no such module"
        locations = [str(p) for p in found]
    return None


def command_problems(snippet: Snippet) -> List[str]:
    """(c) and the argparse options of a script or ``-m`` module the command runs."""
    tokens = split_command(snippet.text)
    if tokens is None:
        return [f"{where(snippet.doc, snippet.line)}: `{snippet.text}`: unbalanced quotes"]
    program, args = program_of(tokens)
    if program is None:
        return []
    at = f"{where(snippet.doc, snippet.line)}: `{snippet.text.strip()}`"
    source = None
    if program.startswith("-m "):
        module = program[3:]
        why = module_runnable(module)
        if why:
            return [f"{at}: python -m {module}: {why}"]
        source = _module_file(module.split(".")) if (ROOT / module.split(".")[0]).is_dir() else None
    elif "*" in program:
        return [] if any(ROOT.glob(program)) else [f"{at}: {program}: no such file"]
    elif program.endswith(".py"):
        source = ROOT / program
    if source is None or not source.is_file():
        return [] if program.startswith("-m ") or (ROOT / program).exists() else [f"{at}: {program}: no such file"]
    parsed = argparse_options(source)
    if parsed is None:
        return []
    options, required = parsed
    out = []
    given = {a.split("=")[0] for a in args if a.startswith("-")}
    for flag in sorted(given - options - {"-h", "--help"}):
        out.append(f"{at}: {flag}: not an option of {source.relative_to(ROOT)}")
    if "..." not in args:
        for flag in sorted(required - given):
            out.append(f"{at}: the required option {flag} of {source.relative_to(ROOT)} is missing")
    return out


def hydra_overrides(snippet: Snippet) -> Optional[List[str]]:
    """The Hydra overrides of a command that runs train.py (or passes them through), else None."""
    tokens = split_command(snippet.text)
    if not tokens:
        return None
    program, args = program_of(tokens)
    if program not in HYDRA_PROGRAMS:
        return None
    return [a for a in args if re.match(r"^[~+]{0,2}[\w./@-]+=", a)]


# -- the scan ----------------------------------------------------------------------------------------
def scan(doc: Path, text: str) -> Dict[str, List[str]]:
    found: Dict[str, List[str]] = {"paths": path_problems(doc, text), "keys": [], "commands": []}
    for snippet in snippets(doc, text):
        found["keys"] += key_problems(snippet)
        if is_command(snippet.text):
            found["commands"] += command_problems(snippet)
    return found


def compose_problems(docs: List[tuple], composed: Optional[list] = None) -> List[str]:
    """Compose (and validate) every train.py-style command with the overrides it writes; the
    commands composed are appended to ``composed``."""
    register()
    out = []
    verdicts: Dict[tuple, Optional[str]] = {}  # overrides -> why they fail (None: they compose and validate)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for doc, text in docs:
            for snippet in snippets(doc, text):
                overrides = hydra_overrides(snippet)
                if overrides is None:
                    continue
                at = f"{where(snippet.doc, snippet.line)}: `{snippet.text.strip()}`"
                placeholders = [o for o in overrides if PLACEHOLDER_RE.search(o.split("=", 1)[1])]
                for o in placeholders:  # `+experiment=NAME`: check the key alone
                    key = o.split("=", 1)[0].lstrip("+~")
                    why = key_problem(key, None)
                    if why:
                        out.append(f"{at}: {key}: {why}")
                if placeholders:
                    continue
                if composed is not None:
                    composed.append(at)
                key = tuple(overrides)
                if key not in verdicts:  # the same overrides in several places are composed once
                    try:
                        validate_config(compose(config_name="config", overrides=overrides))
                        verdicts[key] = None
                    except Exception as exc:  # composition or validation: report and go on
                        verdicts[key] = f"{type(exc).__name__}: {exc}".replace("\n", " ")
                if verdicts[key] is not None:
                    out.append(f"{at}: {verdicts[key]}")
    return out


# Files named in docstrings that belong to other projects.
FOREIGN_FILES = {"convert_llama_weights_to_hf.py"}  # transformers' conversion script
CODE_DIRS = ("configs", "model", "data", "parallel", "training", "metrics", "checkpoint", "recovery", "trainer",
             "planner", "rehearsal", "scripts", "tests")
BARE_FILE_RE = re.compile(r"(?<![\w./<>-])([A-Za-z_][\w-]*\.(?:py|sh|sbatch|md))\b")


def code_files() -> List[Path]:
    return [ROOT / "train.py"] + [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]


def docstring_problems(path: Path, names: Set[str]) -> List[str]:
    """Repository paths and bare file names in ``path``'s docstrings that do not exist."""
    out = []
    tree = ast.parse(path.read_text())
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if not doc:
            continue
        line = node.body[0].lineno if node is not tree else tree.body[0].lineno
        at = f"{path.relative_to(ROOT)}:{line}"
        for m in PATH_RE.finditer(doc):
            ref = m.group(1).rstrip(".,:;)")
            if any(PLACEHOLDER_RE.fullmatch(part.split(".")[0]) for part in ref.split("/")):
                continue
            if not ref.endswith("/") and "." not in ref.rsplit("/", 1)[-1]:
                continue  # a word such as "checkpoint/s", not a file
            ok = any(ROOT.glob(ref)) if "*" in ref else (ROOT / ref).exists()
            if not ok:
                out.append(f"{at}: {ref}: no such file or folder in the repository")
        for m in BARE_FILE_RE.finditer(doc):
            name = m.group(1)
            if name not in names and name not in FOREIGN_FILES and not PLACEHOLDER_RE.fullmatch(name.split(".")[0]):
                out.append(f"{at}: {name}: no file of that name in the repository")
    return out


def repository_file_names() -> Set[str]:
    names: Set[str] = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in {".venv", ".git", "outputs", "__pycache__"}]
        names.update(files)
    return names


def docs_text() -> List[tuple]:
    return [(doc, doc.read_text()) for doc in DOCS]


def report(problems: List[str]) -> str:
    return f"{len(problems)} problem(s) in README.md / docs/*.md:\n  " + "\n  ".join(problems)


def test_docs_are_found():
    assert (ROOT / "README.md").is_file() and len(DOCS) > 3


def test_paths_exist():
    problems = [p for doc, text in docs_text() for p in scan(doc, text)["paths"]]
    assert not problems, report(problems)


def test_docstrings_name_files_that_exist():
    names = repository_file_names()
    problems = [p for path in code_files() for p in docstring_problems(path, names)]
    assert not problems, f"{len(problems)} problem(s) in docstrings:\n  " + "\n  ".join(problems)


def test_the_docstring_check_can_fail(tmp_path):
    bad = ROOT / "tests" / "_docstring_probe_tmp.py"
    bad.write_text('"""See checkpoint/no_such.py and torchrun_graceful.py; checkpoint/durable/ is fine."""\n')
    try:
        found = docstring_problems(bad, repository_file_names())
    finally:
        bad.unlink()
    assert len(found) == 2 and "checkpoint/no_such.py" in found[0] and "torchrun_graceful.py" in found[1], found


def test_config_keys_exist():
    problems = [p for doc, text in docs_text() for p in scan(doc, text)["keys"]]
    assert not problems, report(problems)


def test_python_m_modules_and_options_exist():
    problems = [p for doc, text in docs_text() for p in scan(doc, text)["commands"]]
    assert not problems, report(problems)


def test_commands_compose():
    composed: list = []
    problems = compose_problems(docs_text(), composed)
    assert not problems, report(problems)
    assert len(composed) >= 10, composed  # the scan finds the commands (README alone has several)


def test_the_checks_can_fail(tmp_path):
    """A page with one wrong reference of each kind: each is reported with its file and line."""
    doc = tmp_path / "bad.md"
    text = "\n".join([
        "See parallel/no_such_module.py and DESIGN.md.",                        # 1
        "The margin is `recovery.hard_margin_s`; `checkpoint.interval` is fine.",  # 2
        "```",                                                                  # 3
        "python -m recovery.rehearsal",                                         # 4
        "python -m rehearsal.chains --root R --out result.json",                 # 5
        "python scripts/rehearse.py --no-such-flag 3",                          # 6
        "python train.py +experiment=debug recovery.no_such_key=1",             # 7
        "python train.py +experiment=debug 'recovery.faults=[{kind: bitflip_grad, phase: step}]'",  # 8
        "```",
        "Run `python train.py +experiment=nonexistent`, with `model=nope`.",     # 10
        "The measured facts are in ../shared/PYTORCH-CPU-FACTS.md.",            # 11
    ])
    found = scan(doc, text)
    composed = compose_problems([(doc, text)])
    everything = "\n".join(found["paths"] + found["keys"] + found["commands"] + composed)
    expected = [
        ("bad.md:1", "parallel/no_such_module.py"), ("bad.md:1", "DESIGN.md"),
        ("bad.md:2", "recovery.hard_margin_s"), ("bad.md:4", "python -m recovery.rehearsal"),
        ("bad.md:5", "required option --data"), ("bad.md:6", "--no-such-flag"),
        ("bad.md:7", "recovery.no_such_key"), ("bad.md:8", "bitflip_grad"),
        ("bad.md:10", "+experiment=nonexistent"), ("bad.md:10", "no configs/model/nope.yaml"),
        ("bad.md:11", "../shared/PYTORCH-CPU-FACTS.md: points outside the repository"),
    ]
    for line, ref in expected:
        assert any(line in p and ref in p for p in everything.splitlines()), (line, ref, everything)
    assert "checkpoint.interval" not in everything, everything
