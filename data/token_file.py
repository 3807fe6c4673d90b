"""The prepared dataset on disk: ``tokens.bin`` (flat uint16/uint32 ids) and ``meta.json``.

Documents are concatenated, each followed by the tokenizer's EOS id. ``meta.json`` holds
the tokenizer, vocab size, EOS id, dtype, token and document counts, the sources, and the
sha256 of ``tokens.bin`` (the dataset fingerprint that checkpoints record). With a validation
fraction, the documents data/split.py holds out go to the ``validation`` sub-folder instead
(a prepared dataset of its own) and ``meta.json`` describes the split in its ``validation`` block.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from data.prepared import META_FILE, DataError, prepare_command, unfinished_shards
from data.sources import TEXT_COLUMN, iter_documents
from data.split import SPLIT_RULE, VALIDATION_DIR, ValidationSplit, check_fraction, held_out
from data.tokenizer import make_tokenizer, tokenizer_identity

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"


@dataclass
class TokenFileMeta:
    format_version: int
    tokenizer: str
    vocab_size: int
    eos_id: int
    dtype: str
    num_tokens: int
    num_documents: int
    sha256: str
    sources: List[str]
    # The tokenizer's identity, one block (data/tokenizer.py: kind, vocab_size, eos_id, the sha256 of
    # the tokenizer.json saved beside the tokens, the file it came from); absent in older datasets.
    tokenizer_identity: Optional[Dict] = None
    # The held-out validation split (data/split.py: ValidationSplit as a dict); None: nothing held out.
    validation: Optional[dict] = None


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def prepare_token_file(out_dir: str | Path, sources: List[str], tokenizer: str = "byte",
                       bpe_vocab_size: int = 4096, validation_fraction: float = 0.0,
                       text_column: str = TEXT_COLUMN) -> TokenFileMeta:
    """Tokenize ``sources`` into ``out_dir``; written to a temporary folder, then renamed.

    ``validation_fraction`` > 0 holds documents out of training (data/split.py) into
    ``out_dir/validation``; a BPE tokenizer is then trained on the training documents only.
    The rename makes concurrent preparation by several ranks harmless: the output is a
    pure function of the inputs and the first finished copy wins.
    """
    check_fraction(validation_fraction)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        training_docs = (t for t in iter_documents(sources, text_column) if not held_out(t, validation_fraction))
        tok = make_tokenizer(tokenizer, training_docs, bpe_vocab_size)  # a BPE learns from training documents only
        dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
        split = {False: TokenWriter(tmp, dtype)}  # held out? -> where its tokens go
        if validation_fraction > 0:
            split[True] = TokenWriter(tmp / VALIDATION_DIR, dtype)
        for text in iter_documents(sources, text_column):
            ids = tok.encode(text)
            ids.append(tok.eos_id)
            split[held_out(text, validation_fraction)].write(ids)
        train = split[False].close()
        val = split[True].close() if True in split else None
        if train.num_documents == 0:
            held = f" for training (all {val.num_documents} were held out for validation)" if val else ""
            raise ValueError(f"data sources {sources} yielded no documents{held}")
        tok.save(tmp)
        meta = TokenFileMeta(
            format_version=FORMAT_VERSION, tokenizer=tok.name, vocab_size=tok.vocab_size,
            eos_id=tok.eos_id, dtype=np.dtype(dtype).name, num_tokens=train.num_tokens,
            num_documents=train.num_documents, sha256=train.sha256, sources=list(sources),
            tokenizer_identity=tokenizer_identity(tok, tmp),
        )
        if val is not None:
            if val.num_documents == 0:
                raise ValueError(
                    f"validation fraction {validation_fraction} held out none of the {train.num_documents} "
                    f"documents of {sources}; raise it, or prepare a separate validation set and pass it as "
                    "data.validation=<path>")
            tok.save(tmp / VALIDATION_DIR)
            val_meta = TokenFileMeta(**{**asdict(meta), "num_tokens": val.num_tokens,
                                        "num_documents": val.num_documents, "sha256": val.sha256})
            (tmp / VALIDATION_DIR / META_FILE).write_text(meta_json(val_meta))
            meta.validation = asdict(ValidationSplit(
                fraction=validation_fraction, rule=SPLIT_RULE, path=VALIDATION_DIR,
                num_documents=val.num_documents, num_tokens=val.num_tokens, sha256=val.sha256))
        (tmp / META_FILE).write_text(meta_json(meta))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / META_FILE).exists():
                raise  # not a lost race: something else is in the way
        return read_meta(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def meta_json(meta: TokenFileMeta) -> str:
    """meta.json's text; without a split there is no validation block (the file is as before splits existed)."""
    fields = asdict(meta)
    if fields["validation"] is None:
        del fields["validation"]
    return json.dumps(fields, indent=2) + "\n"


@dataclass
class _Written:
    num_tokens: int
    num_documents: int
    sha256: str


class TokenWriter:
    """Appends documents' ids to ``directory``/tokens.bin; ``close`` fsyncs and hashes it."""

    def __init__(self, directory: Path, dtype):
        directory.mkdir(parents=True, exist_ok=True)
        self.path, self.dtype = directory / TOKENS_FILE, dtype
        self.file = self.path.open("wb")
        self.num_tokens = self.num_documents = 0

    def write(self, ids: List[int]) -> None:
        self.file.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self.num_tokens += len(ids)
        self.num_documents += 1

    def close(self) -> _Written:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return _Written(self.num_tokens, self.num_documents, sha256_file(self.path))


def read_meta(path: str | Path) -> TokenFileMeta:
    path = Path(path)
    meta_path, tokens_path = path / META_FILE, path / TOKENS_FILE
    if not meta_path.is_file() or not tokens_path.is_file():
        raise DataError(
            f"no prepared dataset at {path} (expected {TOKENS_FILE} and {META_FILE}); "
            f"prepare it with: {prepare_command(path)}  (or set data.prepare_if_missing=true)"
        )
    meta = TokenFileMeta(**json.loads(meta_path.read_text()))
    if meta.format_version != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta.format_version}, expected {FORMAT_VERSION}")
    expected = meta.num_tokens * np.dtype(meta.dtype).itemsize
    actual = tokens_path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"{tokens_path} is {actual} bytes but meta.json says {meta.num_tokens} tokens of "
            f"{meta.dtype} ({expected} bytes): the file is truncated or stale; prepare it again"
        )
    return meta


class TokenFile:
    """Read-only memory map of a prepared dataset; cheap to open in every worker.

    Pickling (a dataloader worker started with spawn/forkserver) sends the path, never the
    mapped tokens: the worker maps the file again.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.tokens = _map(self.path / TOKENS_FILE, self.meta)

    def __len__(self) -> int:
        return self.meta.num_tokens

    def __getstate__(self) -> dict:
        return {"path": self.path, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.path, self.meta = state["path"], state["meta"]
        self.tokens = _map(self.path / TOKENS_FILE, self.meta)


def _map(path: Path, meta: TokenFileMeta) -> np.ndarray:
    """The ids, memory-mapped; an empty shard (a sharded preparation's piece whose documents were all held
    out) is an empty array, since an empty file cannot be mapped."""
    if meta.num_tokens == 0:
        return np.zeros(0, dtype=meta.dtype)
    return np.memmap(path, dtype=meta.dtype, mode="r")


def find_token_files(path: str | Path) -> List[Path]:
    """A prepared dataset folder, or a folder whose sub-folders are prepared shards (sorted)."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return [path]
    missing = unfinished_shards(path)  # a sharded preparation is read only when complete
    if missing:
        raise DataError(f"the preparation of {path} is unfinished: {len(missing)} planned shard(s) are not in place "
                        f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); run the same "
                        "scripts/prepare_data.py command again to finish it")
    shards = sorted(p.parent for p in path.glob(f"*/{META_FILE}") if not p.parent.name.startswith(".")) \
        if path.is_dir() else []
    if not shards:
        read_meta(path)  # raises the "no prepared dataset ... prepare it with" error
    return shards
