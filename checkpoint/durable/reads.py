"""Reads of shared storage that decide what every rank does next: made once, on rank 0, retried while
the storage fails, and the answer (or the same error) given to every rank.

A listing of checkpoint.dir, a manifest, the lease's record or model.init_from's small files decide which
collectives the ranks run next; read on every rank, one rank's EIO would send it another way than its
peers (and 512 ranks would read the same files). A storage failure (an OSError such as EIO, ESTALE or a
timeout; CheckpointUnreadable) proves nothing about what is stored: rank 0 reads again ``retries`` times,
the wait doubling from ``backoff_s``, then every rank raises the same CheckpointUnreadable (exit 1; the
next attempt reads again). A lasting answer (a missing file, a permission refused) is not retried.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Tuple, Type, TypeVar

from checkpoint.durable.manifest import CheckpointUnreadable, storage_failure
from parallel import collectives

log = logging.getLogger("trainer")

T = TypeVar("T")
READ_RETRIES, READ_RETRY_BACKOFF_S = 3, 2.0  # recovery.read_retries and read_retry_backoff_s's defaults


def read_on_rank0(read: Callable[[], T], what: str, retries: int = READ_RETRIES,
                  backoff_s: float = READ_RETRY_BACKOFF_S, errors: Tuple[Type[Exception], ...] = ()) -> T:
    """``read()`` on rank 0; after a storage failure, again ``retries`` times (the wait doubling from
    ``backoff_s``), then CheckpointUnreadable naming ``what``. Its answer on every rank: CheckpointUnreadable,
    the ``errors`` types and a lasting OSError it raises are raised on every rank alike (a collective: every
    rank calls it); any other exception is not retried."""
    def on_rank0() -> T:
        for tries in range(retries + 1):
            try:
                return read()
            except Exception as exc:
                failure = storage_failure(exc)
                if failure is None:
                    raise
                if tries == retries:
                    raise CheckpointUnreadable(f"{what} could not be read after {retries} retries: {failure}") from exc
                wait = backoff_s * 2 ** tries
                log.warning("%s: the storage did not deliver (%s); reading again in %.1f s (retry %d of %d)",
                            what, failure, wait, tries + 1, retries)
                time.sleep(wait)

    return collectives.decided_on_rank0(on_rank0, errors=(CheckpointUnreadable, *errors, OSError))
