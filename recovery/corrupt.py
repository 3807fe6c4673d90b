"""Damage a committed checkpoint the way real storage does, to prove it is detected.

Each kind is deterministic (the largest data file is chosen, the byte in its middle is
flipped) so a test that corrupts a checkpoint knows exactly what the loader must catch.
"""

from __future__ import annotations

import os
from pathlib import Path

CORRUPTIONS = ("truncate", "flip_byte", "delete_file", "delete_manifest")
MANIFEST_NAMES = ("manifest.json", "MANIFEST.json", "MANIFEST")


def _manifest(path: Path) -> Path | None:
    for name in MANIFEST_NAMES:
        if (path / name).exists():
            return path / name
    return None


def _largest_data_file(path: Path) -> Path:
    manifest = _manifest(path)
    files = [p for p in path.rglob("*") if p.is_file() and p != manifest]
    if not files:
        raise FileNotFoundError(f"no data files to corrupt in {path}")
    return max(files, key=lambda p: (p.stat().st_size, str(p)))


def corrupt_checkpoint(path: Path, how: str) -> str:
    """Apply corruption ``how`` to the checkpoint directory ``path``; return what was done."""
    if how == "delete_manifest":
        manifest = _manifest(path)
        if manifest is None:
            raise FileNotFoundError(f"no manifest ({', '.join(MANIFEST_NAMES)}) in {path}")
        manifest.unlink()
        return f"deleted {manifest.name}"
    target = _largest_data_file(path)
    size = target.stat().st_size
    if how == "truncate":
        os.truncate(target, size // 2)
        return f"truncated {target.relative_to(path)} from {size} to {size // 2} bytes"
    if how == "flip_byte":
        with open(target, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]))
        return f"flipped byte {size // 2} of {target.relative_to(path)}"
    if how == "delete_file":
        target.unlink()
        return f"deleted {target.relative_to(path)}"
    raise ValueError(f"corruption {how!r}: choose one of {list(CORRUPTIONS)}")
