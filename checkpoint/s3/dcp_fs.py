"""DCP's file-system interface over S3, so DCP's writer and reader (and ours, which extend them)
plan, write ``.metadata`` and read it in a bucket as they do in a folder."""

from __future__ import annotations

import io
from contextlib import contextmanager
from typing import Generator

from torch.distributed.checkpoint.filesystem import FileSystemBase

from checkpoint.s3.path import S3Path, is_s3


class S3FileSystem(FileSystemBase):
    @contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        path = self.init_path(path)
        if mode == "wb":
            with path.open("wb") as stream:
                yield stream
        elif mode == "rb":  # .metadata and stock DCP items: unpickled, so read whole (small)
            yield io.BytesIO(path.read_bytes())
        else:
            raise ValueError(f"S3FileSystem.create_stream: mode {mode!r}")

    def concat_path(self, path, suffix: str) -> S3Path:
        return self.init_path(path) / suffix

    def rename(self, path, new_path) -> None:
        """DCP writes ``.metadata`` as a temporary name first: copied on the server, then deleted."""
        src, dst = self.init_path(path), self.init_path(new_path)
        dst.write_bytes(src.read_bytes())
        src.unlink(missing_ok=True)

    def init_path(self, path) -> S3Path:
        return path if isinstance(path, S3Path) else S3Path(str(path))

    def mkdir(self, path) -> None:
        pass  # a prefix exists once an object lies under it

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return is_s3(checkpoint_id)

    def exists(self, path) -> bool:
        return self.init_path(path).is_file()

    def rm_file(self, path) -> None:
        self.init_path(path).unlink(missing_ok=True)
