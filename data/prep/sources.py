"""Documents to tokenize: built-in offline corpora and a user's own files.

Every machine with Python has two corpora of real text: ``pydoc`` (the standard library's
``pydoc_data`` help topics, ~0.46 MB of English prose) and ``stdlib`` (the standard
library's own ``.py`` files, several MB of code and docstrings). A user's source is a file or a
folder of them: ``.txt`` (one document), ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one record per
line) and ``.parquet`` (one row per document, the FineWeb layout); a record's text is in the
column ``text_column`` ("text" unless told). Order is sorted, so the same sources always give the
same documents in the same order: the sharded preparation (data/prep/shards.py) relies on it.

A document without text (an empty string, a null, an empty file) is dropped (``has_text``), the rule
datatrove's readers apply (``if not text``), so scripts/prepare_datatrove.py and this preparation give the
same documents: a kept one would be a document of its end-of-document token alone. A whitespace-only
document is text and is kept: its bytes are tokens of every tokenizer here, and which documents are junk
is a quality filter's question (docs/data.md).
"""

from __future__ import annotations

import gzip
import io
import json
import sysconfig
from pathlib import Path
from typing import Iterator, List

BUILTIN_SOURCES = ("pydoc", "stdlib")
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")  # what a source file may be
TEXT_COLUMN = "text"


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


def source_suffix(path: Path) -> str:
    """The suffix that decides how ``path`` is read ("" when it is not a source file)."""
    name = path.name
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), "")


def _open_text(path: Path):
    suffix = source_suffix(path)
    if suffix == ".jsonl.gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if suffix == ".jsonl.zst":
        import zstandard

        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(path.open("rb")), encoding="utf-8")
    return path.open(encoding="utf-8")


def has_text(text) -> bool:
    """Whether a document is kept: it has text (not "" and not a null). Whitespace counts as text."""
    return bool(text)


def _jsonl_documents(path: Path, text_column: str) -> Iterator[str]:
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if text_column not in record:
                raise ValueError(f"{path}:{line_no}: a .jsonl record needs a \"{text_column}\" field (it has "
                                 f"{sorted(record)[:8]}); name the text field with --text-column")
            text = record[text_column]
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{path}:{line_no}: the \"{text_column}\" field is {type(text).__name__} "
                                 f"{text!r:.40}, not text; name the text field with --text-column")
            yield text


def _parquet_documents(path: Path, text_column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    if text_column not in f.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_column!r} (columns: {f.schema_arrow.names[:12]}); name the text "
                         "column with --text-column")
    kind = f.schema_arrow.field(text_column).type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise ValueError(f"{path}: column {text_column!r} holds {kind}, not text; name the text column with "
                         "--text-column")
    for batch in f.iter_batches(columns=[text_column], batch_size=4096):  # one row group at a time, not the file
        yield from batch.column(0).to_pylist()


def file_documents(path: Path, text_column: str = TEXT_COLUMN) -> Iterator[str]:
    """A .txt file is one document; .jsonl(.gz, .zst) one per line, .parquet one per row (nulls and empty
    ones included: unit_documents drops them)."""
    suffix = source_suffix(path)
    if suffix == ".txt":
        yield path.read_text(encoding="utf-8")
    elif suffix == ".parquet":
        yield from _parquet_documents(path, text_column)
    elif suffix:
        yield from _jsonl_documents(path, text_column)
    else:
        raise ValueError(f"unsupported data source {path}: expected one of {list(SUFFIXES)}")


def source_files(source: str) -> List[Path]:
    """The files of a user's source (itself, or a folder's source files in sorted order)."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and source_suffix(p))
        if not files:
            raise ValueError(f"data source directory {path} holds no {'/'.join(SUFFIXES)} files")
        return files
    if path.is_file():
        return [path]
    raise FileNotFoundError(
        f"data source {source!r} is neither a built-in corpus {list(BUILTIN_SOURCES)} "
        f"nor an existing {'/'.join(SUFFIXES)} file or directory"
    )


def unit_documents(unit: str, text_column: str = TEXT_COLUMN) -> Iterator[str]:
    """The documents of one unit (a built-in corpus name or one file) that have text (``has_text``)."""
    if unit == "pydoc":
        documents = pydoc_documents()
    elif unit == "stdlib":
        documents = stdlib_documents()  # its empty __init__.py files are dropped
    else:
        documents = file_documents(Path(unit), text_column)
    return (text for text in documents if has_text(text))


def source_units(sources: List[str]) -> List[str]:
    """Every source broken into units read independently: built-in names and files, in order."""
    return [u for s in sources for u in ([s] if s in BUILTIN_SOURCES else [str(p) for p in source_files(s)])]


def iter_documents(sources: List[str], text_column: str = TEXT_COLUMN) -> Iterator[str]:
    for unit in source_units(sources):
        yield from unit_documents(unit, text_column)
