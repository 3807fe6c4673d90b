"""A local or shared file system (NFS, Lustre, a mounted bucket) as a store.

Durable means fsynced: a file is fsynced when its writer closes, and so is its folder, since a
new name is durable only once the folder is. An atomic replace writes a temporary file and
renames it over the name; a create-if-absent hard-links the temporary file to the name, which
fails when the name exists (unless the name is that file: an NFS client's retransmitted link whose
first answer was lost), so a reader sees the whole file or none. Where a file system has no hard
links, the create falls back to ``O_EXCL`` and a write: a crash then leaves a torn file, which a
reader of a manifest treats as no manifest (checkpoint/durable/manifest.py).
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import List, Optional

from checkpoint.storage.base import Entry, Store

WRITE_BUFFER = 8 << 20
NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _FileWriter:
    """A buffered file that is fsynced, with its folder, when closed; ``abort`` removes it."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path, self._f = path, open(path, "wb", buffering=WRITE_BUFFER)

    def write(self, data) -> int:
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self._f.tell()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        except BaseException:
            self.abort()
            raise
        _fsync_dir(os.path.dirname(self.path))

    def abort(self) -> None:
        """Close and remove the file. A full disk fails the buffer's last flush: the descriptor is closed
        all the same (an open one would keep the deleted file's blocks)."""
        raw = self._f.raw
        try:
            self._f.close()
        except OSError:
            pass
        if not raw.closed:
            raw.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "_FileWriter":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.close() if kind is None else self.abort()


class PosixStore(Store):
    def url(self, key: str) -> str:
        return key

    def fspath(self, key: str) -> str:
        return key

    def parent(self, key: str) -> str:
        return os.path.dirname(key) or ("/" if key.startswith("/") else ".")

    def resolve(self, key: str) -> str:
        return os.path.realpath(key)

    def list(self, key: str) -> List[Entry]:
        try:
            with os.scandir(key) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for e in entries:
            try:
                st = e.stat()
            except FileNotFoundError:  # removed while listed
                continue
            out.append(Entry(e.name, st.st_size, st.st_mtime, e.is_dir()))
        return out

    def walk(self, key: str) -> List[Entry]:
        out = []
        for folder, _, files in os.walk(key):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                out.append(Entry(os.path.relpath(path, key), st.st_size, st.st_mtime))
        return out

    def stat(self, key: str) -> Optional[Entry]:
        try:
            st = os.stat(key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return Entry(os.path.basename(key), st.st_size, st.st_mtime) if not os.path.isdir(key) else None

    def is_dir(self, key: str) -> bool:
        return os.path.isdir(key)

    def open_read(self, key: str):
        return open(key, "rb", buffering=0)

    def open_write(self, key: str) -> _FileWriter:
        return _FileWriter(key)

    def _temporary(self, key: str, data: bytes) -> str:
        folder = os.path.dirname(key) or "."
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(key)}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:  # a full disk: nothing of the attempt stays behind
            self.delete(tmp)
            raise
        return tmp

    def write(self, key: str, data: bytes) -> None:
        tmp = self._temporary(key, data)
        try:
            os.replace(tmp, key)
        except BaseException:
            self.delete(tmp)
            raise
        _fsync_dir(os.path.dirname(key))

    def create(self, key: str, data: bytes) -> None:
        tmp = self._temporary(key, data)
        try:
            os.link(tmp, key)
        except FileExistsError:
            if not os.path.samefile(tmp, key):  # else an NFS client's retransmitted link, made by the first try
                raise
        except OSError as exc:
            if exc.errno not in NO_LINKS:
                raise
            fd = os.open(key, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            os.unlink(tmp)
        _fsync_dir(os.path.dirname(key))

    def delete(self, key: str) -> None:
        try:
            os.unlink(key)
        except FileNotFoundError:
            pass

    def delete_tree(self, key: str) -> None:
        if os.path.isdir(key):
            shutil.rmtree(key)

    def prepare(self, key: str) -> None:
        os.makedirs(key, exist_ok=True)

    def free_bytes(self, key: str) -> Optional[int]:
        path = os.path.abspath(key)
        while not os.path.exists(path) and path != os.path.dirname(path):
            path = os.path.dirname(path)
        return shutil.disk_usage(path).free
