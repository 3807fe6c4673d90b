"""Where checkpoints live, behind one small interface.

  base.py    the interface a backend implements (``Store``), and ``Loc``, the path-like name of a file
  posix.py   a local or shared file system (fsync, rename, hard link)
  s3.py      S3 and S3-compatible object stores (boto3: conditional PUT, multipart, ranged GETs)
  dcp.py     torch.distributed.checkpoint's file-system interface over any store

A new backend is one file: a ``Store`` subclass with a ``parse(url) -> (store, key)`` class
method, and a line in STORES below. Nothing outside this package asks which kind of store it has.
"""

from __future__ import annotations

from typing import Dict, Type

from checkpoint.storage.base import Entry, Loc, Store
from checkpoint.storage.posix import PosixStore
from checkpoint.storage.s3 import S3Config, S3Store  # noqa: F401 (S3Config: checkpoint.s3)  # unit: s3

STORES: Dict[str, Type[Store]] = {}  # URL scheme -> backend; anything else is a local path
STORES["s3://"] = S3Store  # unit: s3
_POSIX = PosixStore()


def location(where) -> Loc:
    """``checkpoint.dir``, a checkpoint in it, or any file of theirs, as the store that serves it."""
    if isinstance(where, Loc):
        return where
    text = str(where)
    for scheme, store in STORES.items():
        if text.startswith(scheme):
            return Loc(*store.parse(text))
    return Loc(_POSIX, text)


def configure(settings) -> None:
    """Every backend takes its settings from the checkpoint section (``checkpoint.s3.*``), before any call."""
    for store in STORES.values():
        store.configure(settings)


__all__ = ["Entry", "Loc", "Store", "STORES", "location", "configure"]
