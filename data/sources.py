"""Documents to tokenize: built-in offline corpora and a user's own .txt / .jsonl files.

Every machine with Python has two corpora of real text: ``pydoc`` (the standard library's
``pydoc_data`` help topics, ~0.46 MB of English prose) and ``stdlib`` (the standard
library's own ``.py`` files, several MB of code and docstrings). Order is sorted, so the
same sources always give the same token file.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Iterator, List

BUILTIN_SOURCES = ("pydoc", "stdlib")


def pydoc_documents() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def stdlib_documents() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def file_documents(path: Path) -> Iterator[str]:
    """A .txt file is one document; a .jsonl file has one document per line ("text")."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if "text" not in record:
                    raise ValueError(f"{path}:{line_no}: a .jsonl record needs a \"text\" field")
                yield record["text"]
    elif path.suffix == ".txt":
        yield path.read_text(encoding="utf-8")
    else:
        raise ValueError(f"unsupported data source {path}: expected .txt or .jsonl")


def iter_documents(sources: List[str]) -> Iterator[str]:
    for source in sources:
        if source == "pydoc":
            yield from pydoc_documents()
        elif source == "stdlib":
            yield from stdlib_documents()
        else:
            path = Path(source)
            if path.is_dir():
                files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
                if not files:
                    raise ValueError(f"data source directory {path} holds no .txt or .jsonl files")
                for f in files:
                    yield from file_documents(f)
            elif path.is_file():
                yield from file_documents(path)
            else:
                raise FileNotFoundError(
                    f"data source {source!r} is neither a built-in corpus {list(BUILTIN_SOURCES)} "
                    "nor an existing .txt/.jsonl file or directory"
                )
