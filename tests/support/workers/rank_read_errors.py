"""train.py, except that on one rank every read of the files named fails with EIO: one node of a
parallel file system that cannot read what its peers read (a stale handle, a flaky mount). Run by
tests in place of train.py, with the same arguments:

  READ_ERROR_RANK=1 READ_ERROR_NAMES=manifest.json,config.json \
      torchrun --nproc-per-node 2 tests/support/workers/rank_read_errors.py +experiment=debug ...

Every ``open`` for reading (builtins.open, io.open: pathlib's reads, json files, DCP's .metadata)
of a file whose name is in READ_ERROR_NAMES raises OSError(EIO) on that rank; writes are not
touched. At exit the rank prints ``rank_read_errors: rank R refused N reads: NAMES`` so a test can
tell whether that rank tried to read them at all.
"""

from __future__ import annotations

import atexit
import builtins
import errno
import io
import os
import runpy
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[3] / "train.py"


def install(rank: str, names: set) -> list:
    """Make this process's reads of ``names`` fail; returns the list the refused paths are added to."""
    refused: list = []
    real_open = io.open

    def failing_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).name in names and not set(mode) & set("wax+"):
            refused.append(str(file))
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (rank {rank} cannot read it: the test's fault)",
                          str(file))
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = failing_open
    return refused


def main() -> None:
    rank = os.environ.get("RANK", "0")
    if rank == os.environ["READ_ERROR_RANK"]:
        refused = install(rank, set(os.environ["READ_ERROR_NAMES"].split(",")))
        atexit.register(lambda: print(f"rank_read_errors: rank {rank} refused {len(refused)} reads: "
                                      f"{sorted({Path(p).name for p in refused})}", file=sys.stderr, flush=True))
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()
