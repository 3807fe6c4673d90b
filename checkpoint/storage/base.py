"""The storage interface: what a backend implements (``Store``), and ``Loc``, the path-like name the
checkpoint code gives its files on any store.

A store holds files under ``/``-separated keys; a folder is a key prefix. The commit protocol needs
exactly the methods below, and no rename, so an object store commits the same way as a disk. Every
operation is durable when it returns. Failures are OSErrors: FileNotFoundError for a missing file,
FileExistsError for a refused create, PermissionError for a refused access, others for the storage
failing (retried by callers).
"""

from __future__ import annotations

import fnmatch
import io
import posixpath
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import BinaryIO, Iterator, List, Optional, Tuple


@dataclass(frozen=True)
class Entry:
    """One name in a folder listing (``name`` relative to the folder listed)."""

    name: str
    size: int = 0
    mtime: float = 0.0
    is_dir: bool = False

    @property
    def st_size(self) -> int:  # os.stat_result's names, so Loc.stat() reads like Path.stat()
        return self.size

    @property
    def st_mtime(self) -> float:
        return self.mtime


class Store(ABC):
    """A backend: a disk (checkpoint/storage/posix.py), an object store (checkpoint/storage/s3/)."""

    @abstractmethod
    def url(self, key: str) -> str:
        """The key as the user writes it (a path, ``s3://bucket/key``)."""

    def parent(self, key: str) -> str:
        return posixpath.dirname(key)

    def resolve(self, key: str) -> str:
        """The key in a form that compares equal for the same file (a disk: the absolute path)."""
        return key

    def fspath(self, key: str) -> str:
        """The key as a local file-system path; a store that has none refuses (so nothing writes a local
        folder named ``s3:`` by mistake)."""
        raise TypeError(f"{self.url(key)} is not a local path")

    @abstractmethod
    def list(self, key: str) -> List[Entry]:
        """The files and folders directly under folder ``key`` ([] when there is none)."""

    @abstractmethod
    def walk(self, key: str) -> List[Entry]:
        """Every file under folder ``key`` at any depth, named relative to it."""

    @abstractmethod
    def stat(self, key: str) -> Optional[Entry]:
        """The file ``key`` (None when absent)."""

    @abstractmethod
    def is_dir(self, key: str) -> bool:
        """Whether folder ``key`` exists (on an object store: something lies under it, or it is a bucket)."""

    @abstractmethod
    def open_read(self, key: str) -> io.RawIOBase:
        """A seekable stream with ``readinto``, reading exactly the bytes asked for."""

    @abstractmethod
    def open_write(self, key: str) -> BinaryIO:
        """A new file: ``write``; ``close`` makes it visible and durable; ``abort`` leaves nothing."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Replace file ``key`` with ``data`` atomically: a reader sees the old or the new, never half."""

    @abstractmethod
    def create(self, key: str, data: bytes) -> None:
        """Create file ``key`` holding ``data``, atomically, only if it does not exist (FileExistsError). Idempotent
        under the store's own retries: a retried create that finds these bytes there succeeded (the callers'
        data is unique to its writer)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete file ``key`` (absent: nothing)."""

    @abstractmethod
    def delete_tree(self, key: str) -> None:
        """Delete folder ``key`` and everything under it."""

    @abstractmethod
    def prepare(self, key: str) -> None:
        """Make sure files can be written under folder ``key`` (a disk creates it; a bucket must exist)."""

    @classmethod
    def configure(cls, settings) -> None:
        """Take this process's settings from the checkpoint config section (before any call); a store's own keys
        are a sub-section of it (checkpoint.s3), checked with the config."""

    def abort_unfinished(self, key: str) -> List[str]:
        """End writes under ``key`` that a killed writer left open and the store still keeps (and bills); their
        names. A disk keeps nothing of the kind."""
        return []

    def free_bytes(self, key: str) -> Optional[int]:
        """Free space under ``key``; None where the store has no such number."""
        return None

    def failure_hint(self) -> Optional[Tuple[str, str]]:
        """(what failed, what to do) for a failure that is no disk's errno (ENOSPC and the like): the store's
        own words, e.g. where its endpoint and credentials are set. None: the generic message."""
        return None


class Loc:
    """A file or folder of a store, named like pathlib: ``root / "step_00000100" / "manifest.json"``."""

    __slots__ = ("store", "key")

    def __init__(self, store: Store, key: str):
        self.store, self.key = store, key.rstrip("/") if key not in ("/", "") else key

    # -- names ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        return self.store.url(self.key)

    def __repr__(self) -> str:
        return f"Loc({str(self)!r})"

    def __fspath__(self) -> str:
        return self.store.fspath(self.key)

    def local_path(self) -> Optional[str]:
        """The local file-system path, or None on a store that has none (the checks of local folders skip it)."""
        try:
            return self.store.fspath(self.key)
        except TypeError:
            return None

    def __eq__(self, other) -> bool:
        return isinstance(other, Loc) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: "Loc") -> bool:
        return str(self) < str(other)

    def __truediv__(self, name) -> "Loc":
        name = str(name).strip("/")
        return Loc(self.store, posixpath.join(self.key, name) if self.key else name) if name else self

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def parent(self) -> "Loc":
        return Loc(self.store, self.store.parent(self.key))

    def resolve(self) -> "Loc":
        return Loc(self.store, self.store.resolve(self.key))

    def with_name(self, name: str) -> "Loc":
        return self.parent / name

    # -- queries -------------------------------------------------------------------------------
    def stat(self) -> Entry:
        found = self.store.stat(self.key)
        if found is None:
            raise FileNotFoundError(2, "no such file", str(self))
        return found

    def is_file(self) -> bool:
        return self.store.stat(self.key) is not None

    def is_dir(self) -> bool:
        return self.store.is_dir(self.key)

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def iterdir(self) -> Iterator["Loc"]:
        return iter([self / e.name for e in self.store.list(self.key)])

    def entries(self) -> List[Entry]:
        """The listing of this folder with sizes and times (one request on an object store)."""
        return self.store.list(self.key)

    def glob(self, pattern: str) -> Iterator["Loc"]:
        """Names directly under this folder matching ``pattern``."""
        return iter([self / e.name for e in self.store.list(self.key) if fnmatch.fnmatchcase(e.name, pattern)])

    def walk(self) -> List[Entry]:
        """Every file under this folder, named relative to it, with sizes and times."""
        return self.store.walk(self.key)

    # -- content -------------------------------------------------------------------------------
    def read_bytes(self) -> bytes:
        with self.store.open_read(self.key) as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> None:
        """Replace atomically and durably."""
        self.store.write(self.key, bytes(data))

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def create_bytes(self, data: bytes) -> None:
        """Create only if absent (FileExistsError), atomically and durably."""
        self.store.create(self.key, bytes(data))

    def open(self, mode: str = "rb"):
        if mode == "rb":
            return self.store.open_read(self.key)
        if mode == "wb":
            return self.store.open_write(self.key)
        raise ValueError(f"{self}: open mode {mode!r} (use rb or wb)")

    def unlink(self, missing_ok: bool = False) -> None:
        if not missing_ok and not self.is_file():
            raise FileNotFoundError(2, "no such file", str(self))
        self.store.delete(self.key)

    def rmtree(self) -> None:
        self.store.delete_tree(self.key)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Make sure files can be written under this folder (``parents``/``exist_ok`` for pathlib's callers)."""
        self.store.prepare(self.key)

    def abort_unfinished(self) -> List[str]:
        return self.store.abort_unfinished(self.key)

    def free_bytes(self) -> Optional[int]:
        return self.store.free_bytes(self.key)

    def failure_hint(self) -> Optional[Tuple[str, str]]:
        return self.store.failure_hint()
