"""Token files other engines wrote, trained on in place (no conversion): Megatron's indexed datasets
(``PREFIX.bin`` + ``PREFIX.idx``, data/megatron_source.py) and datatrove's tokenised output
(``NAME.ds`` + ``.ds.index`` + ``.ds.metadata``, data/datatrove_source.py).

``data.path`` names a Megatron prefix (``/data/web_text_document``), or a folder of such pairs or of
``.ds`` files; each file is a shard, in name order, cut into windows like a prepared shard
(data/token_source.py). These files do not say which tokenizer made them, so ``data.tokenizer``
(byte or hf:FILE) does; its vocabulary and EOS id describe the shards, in a meta like a prepared
dataset's. The fingerprint a checkpoint records is a cheap one (``cheap_fingerprint``): the files'
sizes and their first and last MiB, since hashing terabytes at every start is not an option.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import List, Optional, Tuple

MEGATRON, DATATROVE = "megatron", "datatrove"
_EDGE = 1 << 20


class MappedShard:
    """A foreign shard's tokens as a read-only memmap of ``token_file`` (set ``path`` and ``meta``
    first). Pickled for a dataloader worker as its path and meta; the worker maps the file again."""

    path: Path

    @property
    def token_file(self) -> Path:
        return self.path

    def _map(self):
        import numpy as np

        n, dtype = self.meta.num_tokens, self.meta.dtype
        return np.memmap(self.token_file, dtype=dtype, mode="r") if n else np.zeros(0, dtype=dtype)

    def __len__(self) -> int:
        return self.meta.num_tokens

    def __getstate__(self) -> dict:
        return {"path": self.path, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.path, self.meta = state["path"], state["meta"]
        self.tokens = self._map()


def foreign_files(path: str | Path) -> Tuple[Optional[str], List[Path]]:
    """(kind, shards) at ``path``: Megatron prefixes or datatrove .ds files; (None, []) when neither."""
    path = Path(path)
    if Path(f"{path}.idx").is_file():
        return MEGATRON, [path]
    if not path.is_dir():
        return None, []
    prefixes = sorted(p.with_suffix("") for p in path.glob("*.idx") if p.with_suffix(".bin").is_file())
    if prefixes:
        return MEGATRON, prefixes
    ds = sorted(path.glob("*.ds"))
    return (DATATROVE, ds) if ds else (None, [])


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


def described_tokenizer(spec: Optional[str], kind: str, path: Path):
    """The tokenizer ``data.tokenizer`` names, which foreign files need (they do not record theirs)."""
    from data.prepared import DataError
    from data.tokenizer import load_tokenizer_spec

    if spec is None or str(spec) == "bpe":
        raise DataError(f"{path} holds {kind} token files, which do not record their tokenizer; set data.tokenizer to "
                        "the one that made them: byte, or hf:/path/to/tokenizer.json (got "
                        f"{spec!r}; a bpe trained here exists only beside data prepared here)")
    return load_tokenizer_spec(str(spec))


def foreign_meta(tok, kind: str, dtype: str, num_tokens: int, num_documents: int, fingerprint: str, source: Path):
    """A prepared dataset's meta for a foreign shard, its tokenizer the one data.tokenizer names."""
    from data.token_file import FORMAT_VERSION, TokenFileMeta
    from data.tokenizer import FileTokenizer, sha256_of

    identity = {"kind": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                "sha256": sha256_of(tok.path) if isinstance(tok, FileTokenizer) else None,
                "file": str(Path(tok.path).resolve()) if isinstance(tok, FileTokenizer) else None}
    return TokenFileMeta(format_version=FORMAT_VERSION, tokenizer=tok.name, vocab_size=tok.vocab_size,
                         eos_id=tok.eos_id, dtype=dtype, num_tokens=num_tokens, num_documents=num_documents,
                         sha256=fingerprint, sources=[f"{kind}:{source}"], tokenizer_identity=identity)


def open_foreign(path: str | Path, tokenizer: Optional[str]) -> list:
    """The shards of the foreign files at ``path`` (an empty list when there are none)."""
    kind, files = foreign_files(path)
    if kind is None:
        return []
    tok = described_tokenizer(tokenizer, kind, Path(path))
    if kind == MEGATRON:
        from data.megatron_source import MegatronShard

        return [MegatronShard(p, tok) for p in files]
    from data.datatrove_source import DatatroveShard

    return [DatatroveShard(p, tok) for p in files]
