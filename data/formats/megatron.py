"""Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) as a shard, read in place.

The layout is megatron-core's (``megatron/core/datasets/indexed_dataset.py``): the ``.idx`` holds
the magic ``MMIDIDX\\x00\\x00``, version 1 (<Q), a dtype code (<B), the sequence count S and the
document-index count D (<Q each), then S int32 sequence lengths, S int64 byte offsets into the
``.bin`` and D int64 document indices; the ``.bin`` holds the sequences' ids back to back. They
are read here as one stream of tokens, like a prepared ``tokens.bin``: documents follow each other,
each ended by the EOD token when Megatron's preprocessing ran with ``--append-eod`` (a run with
``data.cross_document_loss=false`` needs it). Only the header and the last sequence's offset are
read at start (O(1) in the dataset's size); multimodal indexes (sequence modes) are refused.

``data.path`` names a prefix (``/data/web_text_document``) or a folder of such pairs, each a shard in
name order. Completion: megatron-core's builder writes the ``.idx`` when it finalizes, so a pair
whose ``.bin`` does not end where the ``.idx`` says is truncated or mismatched, and refused. The
files do not record their tokenizer: data.tokenizer's describes them (data/formats/shard.py).
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import List, Optional

import numpy as np

from data.formats.shard import MappedShard, cheap_fingerprint, untagged_meta, untagged_tokenizer
from data.prepared import DataError

log = logging.getLogger("trainer")
NAME = "megatron"
WHAT = "a Megatron indexed dataset's prefix (PREFIX.bin + PREFIX.idx) or a folder of such pairs"
MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


class MegatronShard(MappedShard):
    def __init__(self, prefix: str | Path, tok):
        self.path = Path(prefix)
        idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        with idx.open("rb") as f:
            head = f.read(_HEADER)
            if len(head) < _HEADER or head[:len(MAGIC)] != MAGIC:
                raise DataError(f"{idx} is not a Megatron index (no {MAGIC!r} header); write it with megatron-core's "
                                "IndexedDatasetBuilder or tools/preprocess_data.py")
            version, code, seqs, docs = struct.unpack("<QBQQ", head[len(MAGIC):])
            if version != 1 or code not in DTYPES or not np.issubdtype(DTYPES[code], np.integer):
                raise DataError(f"{idx}: version {version}, dtype code {code}: only version 1 with integer token ids "
                                f"is read ({sorted(c for c, t in DTYPES.items() if np.issubdtype(t, np.integer))})")
            expected = _HEADER + 12 * seqs + 8 * docs
            if idx.stat().st_size != expected:
                raise DataError(f"{idx} is {idx.stat().st_size} bytes, not the {expected} of {seqs} sequences and "
                                f"{docs} document indices: truncated, or multimodal (sequence modes: not supported)")
            dtype = np.dtype(DTYPES[code])
            end = 0
            if seqs:
                f.seek(_HEADER + 4 * (seqs - 1))
                last_len = struct.unpack("<i", f.read(4))[0]
                f.seek(_HEADER + 4 * seqs + 8 * (seqs - 1))
                end = struct.unpack("<q", f.read(8))[0] + last_len * dtype.itemsize
        if bin_.stat().st_size != end:
            raise DataError(f"{bin_} is {bin_.stat().st_size} bytes but {idx} ends its last sequence at byte {end}: "
                            "the pair is truncated or mismatched; write it again")
        if np.iinfo(dtype).max < tok.vocab_size - 1:
            log.warning("%s: dtype %s cannot hold the tokenizer's %d ids", idx, dtype, tok.vocab_size)
        self.meta = untagged_meta(tok, NAME, dtype.name, end // dtype.itemsize, max(0, docs - 1),
                                  cheap_fingerprint(idx, bin_), self.path)
        self.tokens = self._map()
        if len(self.tokens) and int(self.tokens[-1]) != tok.eos_id:
            log.warning("%s does not end with the EOD id %d of data.tokenizer: prepared without --append-eod, or with "
                        "another tokenizer; documents then run into each other", bin_, tok.eos_id)

    @property
    def token_file(self) -> Path:
        return Path(f"{self.path}.bin")


def find(path: Path) -> List[Path]:
    if Path(f"{path}.idx").is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p.with_suffix("") for p in path.glob("*.idx") if p.with_suffix(".bin").is_file())


def open_shards(path: Path, found: List[Path], tokenizer: Optional[str]) -> List[MegatronShard]:
    tok = untagged_tokenizer(tokenizer, NAME, path)
    return [MegatronShard(p, tok) for p in found]
