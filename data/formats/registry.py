"""Which format a data.path holds. A new format is a module beside these (NAME, WHAT, ``find``,
``open_shards``: the Format of data/formats/shard.py) and its entry in FORMATS."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from data.formats import datatrove, megatron, native
from data.formats.shard import Format, Shard
from data.prepared import DataError, prepare_command

FORMATS: Tuple[Format, ...] = (native, megatron, datatrove)


def find_format(path: str | Path) -> Tuple[Optional[Format], List[Path]]:
    """(the first format in FORMATS that finds shards at ``path``, their paths); (None, []) when none does."""
    for fmt in FORMATS:
        found = fmt.find(Path(path))
        if found:
            return fmt, found
    return None, []


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` holds token data of some format (finished or not: opening it tells)."""
    return find_format(path)[0] is not None


def open_shards(path: str | Path, tokenizer: Optional[str] = None) -> List[Shard]:
    """The shards at ``path``; ``tokenizer`` (data.tokenizer) describes files that do not record theirs."""
    fmt, found = find_format(path)
    if fmt is None:
        raise DataError(f"no token data at {path}: expected {'; or '.join(f.WHAT for f in FORMATS)}. Prepare it "
                        f"with: {prepare_command(path)}  (or set data.prepare_if_missing=true)")
    return fmt.open_shards(Path(path), found, tokenizer)
