"""The shard contract: what every token format on disk promises the runtime, written once.

A *shard* is one unit of token ids a format reads in place, never converted: a prepared dataset
(``tokens.bin`` + ``meta.json``, data/formats/native.py), a Megatron ``.bin``/``.idx`` pair
(megatron.py), a datatrove ``.ds`` file (datatrove.py). Whatever its layout, a shard gives:

  tokens       its ids as one flat array, memory-mapped (documents back to back, each ended by the EOS
               id); ``len(shard) == meta.num_tokens``
  meta         a ``ShardMeta``: the tokenizer (name, vocabulary size, EOS id and the identity block that
               training compares with data.tokenizer), the dtype, the token and document counts, and
               ``sha256``: the fingerprint a checkpoint's data state records
  completion   it opens only when its writer marked it complete (each format says how); an unfinished,
               truncated or mismatched shard raises DataError naming the fix
  pickling     as its path and meta: a dataloader worker maps the file again, never receives the tokens

Windows are cut alike for every format (``num_windows``, ``window``), so the sample order does not
depend on where the tokens came from. A *format* (``Format``) finds the shards at a data.path and
opens them; data/formats/registry.py lists the formats.

Files another engine wrote do not record their tokenizer: for them ``data.tokenizer`` supplies it
(``untagged_tokenizer``, ``untagged_meta``), and their fingerprint is a cheap one (``cheap_fingerprint``:
names, sizes, first and last MiB), since hashing terabytes at every start is not an option.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Protocol

import numpy as np

from data.prepared import DataError
from data.tokenizer import load_tokenizer_spec, tokenizer_identity

FORMAT_VERSION = 1  # of ShardMeta, which a prepared dataset's meta.json holds
_EDGE = 1 << 20


@dataclass
class ShardMeta:
    format_version: int
    tokenizer: str
    vocab_size: int
    eos_id: int
    dtype: str
    num_tokens: int
    num_documents: int
    sha256: str  # the fingerprint: of tokens.bin for a prepared dataset, cheap_fingerprint for other engines'
    sources: List[str]
    # The tokenizer's identity, one block (data/tokenizer.py: kind, vocab_size, eos_id, the sha256 of
    # its tokenizer.json, the file it came from); absent in older datasets.
    tokenizer_identity: Optional[Dict] = None
    # The held-out validation split (data/prep/split.py: ValidationSplit as a dict); None: nothing held out.
    validation: Optional[dict] = None


class Shard(Protocol):
    """What the runtime reads of a shard (the guarantees are above)."""

    path: Path
    meta: ShardMeta
    tokens: np.ndarray

    def __len__(self) -> int: ...


class Format(Protocol):
    """A format as the registry sees it (a module: NAME, WHAT, find, open_shards)."""

    NAME: str
    WHAT: str  # what data.path names in this format, for the message when no format finds anything

    def find(self, path: Path) -> List[Path]:
        """The shards' paths at ``path``, in order; [] when ``path`` holds nothing of this format.
        Cheap (names and sizes): the start-up checks call it."""

    def open_shards(self, path: Path, found: List[Path], tokenizer: Optional[str]) -> List[Shard]:
        """The shards ``find`` found, opened; ``tokenizer`` is data.tokenizer (None in tools that
        read data of this project only)."""


class MappedShard:
    """A shard whose tokens are a read-only memmap of ``token_file`` (set ``path`` and ``meta`` first)."""

    path: Path
    meta: ShardMeta

    @property
    def token_file(self) -> Path:
        return self.path

    def _map(self) -> np.ndarray:
        """The ids; an empty shard (a piece whose documents were all held out) is an empty array, since an
        empty file cannot be mapped."""
        n, dtype = self.meta.num_tokens, self.meta.dtype
        return np.memmap(self.token_file, dtype=dtype, mode="r") if n else np.zeros(0, dtype=dtype)

    def __len__(self) -> int:
        return self.meta.num_tokens

    def __getstate__(self) -> dict:
        return {"path": self.path, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.path, self.meta = state["path"], state["meta"]
        self.tokens = self._map()


def num_windows(shard: Shard, seq_len: int) -> int:
    """A shard of T tokens gives (T - 1) // seq_len windows of seq_len + 1 tokens; neighbours share one
    token, so every token but the last is a target once per epoch, and no window spans two shards."""
    return max(0, (len(shard) - 1) // seq_len)


def window(shard: Shard, w: int, seq_len: int) -> np.ndarray:
    start = w * seq_len
    return shard.tokens[start:start + seq_len + 1]


def cheap_fingerprint(*files: Path) -> str:
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            digest.update(fh.read(_EDGE))
            if size > _EDGE:
                fh.seek(max(_EDGE, size - _EDGE))
                digest.update(fh.read(_EDGE))
    return digest.hexdigest()


def untagged_tokenizer(spec: Optional[str], kind: str, path: Path):
    """The tokenizer ``data.tokenizer`` names, which files that do not record theirs need."""
    if spec is None or str(spec) == "bpe":
        raise DataError(f"{path} holds {kind} token files, which do not record their tokenizer; set data.tokenizer to "
                        "the one that made them: byte, or hf:/path/to/tokenizer.json (got "
                        f"{spec!r}; a bpe trained here exists only beside data prepared here)")
    return load_tokenizer_spec(str(spec))


def untagged_meta(tok, kind: str, dtype: str, num_tokens: int, num_documents: int, fingerprint: str,
                  source: Path) -> ShardMeta:
    """The meta of a shard that does not record its tokenizer: the one data.tokenizer names."""
    identity = tokenizer_identity(tok, getattr(tok, "path", None))  # a FileTokenizer's file, or none
    return ShardMeta(format_version=FORMAT_VERSION, tokenizer=tok.name, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
                     dtype=dtype, num_tokens=num_tokens, num_documents=num_documents, sha256=fingerprint,
                     sources=[f"{kind}:{source}"], tokenizer_identity=identity)
