"""Where checkpoints live: a local folder (``Path``) or an S3 prefix (``checkpoint/s3/path.py``).

The durable tier names its files with pathlib operations, which both kinds answer; the few
operations that differ are here, one function each, so the rest of the tier reads the same for
both. On a disk a directory is renamed into place and fsynced; on S3 there is no rename and an
object is durable once its PUT returns, so those become what the commit protocol needs there
(checkpoint/durable/commit.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Union

from checkpoint.s3.path import S3Path, is_s3

Location = Union[Path, S3Path]


def location(where) -> Location:
    """``checkpoint.dir`` (or a checkpoint inside it) as the kind of path that serves it."""
    if isinstance(where, (Path, S3Path)):
        return where
    return S3Path(str(where)) if is_s3(where) else Path(where)


def on_object_store(where) -> bool:
    return is_s3(where)


def open_write(path: Location, exclusive: bool = False):
    """A data file being written: a buffered local file, or a multipart upload."""
    if isinstance(path, S3Path):
        return path.open("wb", exclusive=exclusive)
    return open(path, "xb" if exclusive else "wb", buffering=8 << 20)


def open_read(path: Location):
    """A data file to ``seek`` and ``readinto``: an unbuffered local file, or ranged GETs."""
    return path.open("rb") if isinstance(path, S3Path) else open(path, "rb", buffering=0)


def remove_tree(path: Location) -> None:
    """Delete a directory and all in it (on S3 the manifest first: a checkpoint being deleted
    stops being committed before its data goes)."""
    if isinstance(path, S3Path):
        from checkpoint.durable.layout import MANIFEST

        (path / MANIFEST).unlink(missing_ok=True)
        path.rmtree()
    else:
        shutil.rmtree(path)


def move_tree(src: Location, dst: Location) -> None:
    """Move a directory to another name: a rename on a disk; on S3 a server-side copy and a
    delete (not atomic: used only for names that nothing resumes from)."""
    if isinstance(src, S3Path):
        src.copy_tree(dst)
        remove_tree(src)
    else:
        os.rename(src, dst)


def create_exclusive(path: Location, data: bytes) -> None:
    """Create ``path`` holding ``data`` unless it exists (FileExistsError): O_EXCL, or a PUT with
    ``If-None-Match: *``."""
    if isinstance(path, S3Path):
        path.write_bytes(data, exclusive=True)
        return
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def touch(path: Location) -> None:
    """Renew ``path``'s modification time (a heartbeat)."""
    if isinstance(path, S3Path):
        path.touch()
    else:
        os.utime(path)


def free_bytes(root: Location) -> Optional[int]:
    """Free space under ``root``; None on an object store, which has no such number."""
    if isinstance(root, S3Path):
        return None
    return shutil.disk_usage(root).free
