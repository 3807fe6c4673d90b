"""One data source: the shards at a data.path, in any format (data/formats/registry.py), cut into
training windows.

A window is ``seq_len + 1`` consecutive tokens (the inputs plus the shifted targets), cut as the
shard contract says (data/formats/shard.py): never across two shards. A source's windows are
numbered shard after shard: ``num_sequences`` in all. Every shard of a source uses one tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import numpy as np

from data.formats.registry import open_shards
from data.formats.shard import num_windows, window


class TokenSource:
    def __init__(self, path: str | Path, seq_len: int, tokenizer: Optional[str] = None):
        if seq_len < 1:
            raise ValueError(f"training.seq_len must be >= 1, got {seq_len}")
        self.path = Path(path)
        self.seq_len = seq_len
        self.shards = open_shards(path, tokenizer)
        first = self.shards[0].meta
        for shard in self.shards[1:]:
            m = shard.meta
            if (m.tokenizer, m.vocab_size, m.eos_id) != (first.tokenizer, first.vocab_size, first.eos_id):
                raise ValueError(
                    f"shards of {path} use different tokenizers: {self.shards[0].path} has {first.tokenizer} "
                    f"(vocab {first.vocab_size}, eos {first.eos_id}), {shard.path} has {m.tokenizer} "
                    f"(vocab {m.vocab_size}, eos {m.eos_id}); prepare them with the same tokenizer"
                )
        counts = [num_windows(s, seq_len) for s in self.shards]
        self.shard_starts = np.cumsum([0] + counts)  # window id where each shard begins
        self.num_sequences = int(self.shard_starts[-1])
        if self.num_sequences < 1:
            raise ValueError(
                f"data source {path} has {sum(len(s) for s in self.shards)} tokens, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1} in any shard; use more data or a shorter training.seq_len"
            )

    @property
    def tokenizer(self) -> tuple[str, int, int]:
        m = self.shards[0].meta
        return m.tokenizer, m.vocab_size, m.eos_id

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.shards)

    @property
    def shard_hashes(self) -> List[str]:
        return [s.meta.sha256 for s in self.shards]

    def read(self, window_ids: np.ndarray) -> np.ndarray:
        """Rows of ``seq_len + 1`` tokens (int64) for the given window ids, in that order."""
        shard_ids = np.searchsorted(self.shard_starts, window_ids, side="right") - 1
        out = np.empty((len(window_ids), self.seq_len + 1), dtype=np.int64)
        for row, (shard, w) in enumerate(zip(shard_ids, window_ids)):
            out[row] = window(self.shards[shard], int(w) - int(self.shard_starts[shard]), self.seq_len)
        return out
