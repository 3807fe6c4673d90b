"""Where checkpoints live, behind one small interface.

  base.py    the interface a backend implements (``Store``), and ``Loc``, the path-like name of a file
  posix.py   a local or shared file system (fsync, rename, hard link)
  s3/        S3 and S3-compatible object stores (boto3: conditional PUT, multipart, ranged GETs)
  dcp.py     torch.distributed.checkpoint's file-system interface over any store

A new backend is one module: a ``Store`` subclass with a ``parse(url) -> (store, key)`` class
method, and a line in STORES below; it is imported at the first URL of its scheme, so a run on a
disk loads no object-store client. Nothing outside this package asks which kind of store it has.
"""

from __future__ import annotations

import importlib
from typing import Dict, Optional, Type

from checkpoint.storage.base import Entry, Loc, Store
from checkpoint.storage.posix import PosixStore

STORES: Dict[str, str] = {}  # URL scheme -> "module:Class" of its backend; anything else is a local path
STORES["s3://"] = "checkpoint.storage.s3.store:S3Store"  # unit: s3
_POSIX = PosixStore()
_loaded: Dict[str, Type[Store]] = {}
_settings = None  # the checkpoint section, once configure() has seen it


def backend(scheme: str) -> Type[Store]:
    """The backend class of a URL scheme, imported (and handed the settings) at its first use."""
    if scheme not in _loaded:
        module, _, name = STORES[scheme].partition(":")
        cls = getattr(importlib.import_module(module), name)
        if _settings is not None:
            cls.configure(_settings)
        _loaded[scheme] = cls
    return _loaded[scheme]


def location(where) -> Loc:
    """``checkpoint.dir``, a checkpoint in it, or any file of theirs, as the store that serves it."""
    if isinstance(where, Loc):
        return where
    text = str(where)
    for scheme in STORES:
        if text.startswith(scheme):
            return Loc(*backend(scheme).parse(text))
    return Loc(_POSIX, text)


def local_path(where) -> Optional[str]:
    """``where`` as a path on this host's file system, or None when a store's URL names it (no backend imported)."""
    text = str(where)
    return None if any(text.startswith(scheme) for scheme in STORES) else text


def configure(settings) -> None:
    """Every backend takes its settings from the checkpoint section (``checkpoint.s3.*``) before its first
    call: those imported already now, the others when they are."""
    global _settings
    _settings = settings
    for store in _loaded.values():
        store.configure(settings)


__all__ = ["Entry", "Loc", "Store", "STORES", "backend", "location", "local_path", "configure"]
