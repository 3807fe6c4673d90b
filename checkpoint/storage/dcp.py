"""torch.distributed.checkpoint's file-system interface over any store, so DCP's writers and readers
(and ours, which extend them: checkpoint/durable/writer.py, reader.py) plan, write and read the same
way on a disk and in a bucket. Reads are buffered in large blocks: stock DCP unpickles each tensor
through small reads, which on an object store would each be a request."""

from __future__ import annotations

import io
import pickle
from contextlib import contextmanager
from typing import Generator

from torch.distributed.checkpoint.filesystem import FileSystemBase

from checkpoint.storage import Loc, location

READ_BUFFER = 8 << 20


class StoreFileSystem(FileSystemBase):
    @contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        loc = self.init_path(path)
        if mode == "wb":
            with loc.open("wb") as stream:  # visible and durable when it closes
                yield stream
        elif mode == "rb":
            with io.BufferedReader(loc.open("rb"), READ_BUFFER) as stream:
                yield stream
        else:
            raise ValueError(f"StoreFileSystem.create_stream: mode {mode!r}")

    def concat_path(self, path, suffix: str) -> Loc:
        return self.init_path(path) / suffix

    def rename(self, path, new_path) -> None:
        """Not used by our writers (``write_metadata``); a copy and a delete for any other caller."""
        src = self.init_path(path)
        self.init_path(new_path).write_bytes(src.read_bytes())
        src.unlink(missing_ok=True)

    def init_path(self, path) -> Loc:
        return location(path)

    def mkdir(self, path) -> None:
        pass  # a store creates a file's folder with the file

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return self.init_path(path).is_file()

    def rm_file(self, path) -> None:
        self.init_path(path).unlink(missing_ok=True)


def use_store(storage, path) -> None:
    """Point a DCP FileSystemWriter/Reader at ``path``'s store."""
    storage.fs = StoreFileSystem()
    storage.path = storage.fs.init_path(path)


def write_metadata(directory: Loc, metadata) -> None:
    """``.metadata`` in one atomic write (DCP's own finish writes a temporary name and renames it)."""
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
