"""Text to a prepared dataset (its layout and completion marker: data/formats/native.py): the writer both
preparations share, documents tokenized and each followed by EOS, those data/prep/split.py holds out
into the validation sub-folder; and the single-process preparation.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, List

import numpy as np

from data.formats.native import META_FILE, TOKENS_FILE, VALIDATION_DIR, read_meta
from data.formats.shard import FORMAT_VERSION, ShardMeta
from data.prep.bpe import make_tokenizer
from data.prep.sources import TEXT_COLUMN, iter_documents
from data.prep.split import SPLIT_RULE, ValidationSplit, check_fraction, held_out
from data.tokenizer import TOKENIZER_JSON, tokenizer_identity


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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


def meta_json(meta: ShardMeta) -> str:
    """meta.json's text; without a split there is no validation block (the file is as before splits existed)."""
    fields = asdict(meta)
    if fields["validation"] is None:
        del fields["validation"]
    return json.dumps(fields, indent=2) + "\n"


def write_dataset(folder: Path, documents: Iterable[str], tok, fraction: float, sources: List[str],
                  validation_path: str = VALIDATION_DIR) -> ShardMeta:
    """``documents`` tokenized into the prepared dataset ``folder``; with ``fraction`` > 0 the ones the
    split holds out into ``folder``/validation, whose place the training meta's validation block records
    as ``validation_path``. The tokenizer is saved beside both. Returns the training meta."""
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    split = {False: TokenWriter(folder, dtype)}  # held out? -> where its tokens go
    if fraction > 0:
        split[True] = TokenWriter(folder / VALIDATION_DIR, dtype)
    for text in documents:
        ids = tok.encode(text)
        ids.append(tok.eos_id)
        split[held_out(text, fraction)].write(ids)
    train = split[False].close()
    tok.save(folder)
    meta = ShardMeta(format_version=FORMAT_VERSION, tokenizer=tok.name, vocab_size=tok.vocab_size,
                     eos_id=tok.eos_id, dtype=np.dtype(dtype).name, num_tokens=train.num_tokens,
                     num_documents=train.num_documents, sha256=train.sha256, sources=list(sources),
                     tokenizer_identity=tokenizer_identity(tok, folder / TOKENIZER_JSON))
    if fraction > 0:
        val = split[True].close()
        tok.save(folder / VALIDATION_DIR)
        val_meta = ShardMeta(**{**asdict(meta), "num_tokens": val.num_tokens, "num_documents": val.num_documents,
                                "sha256": val.sha256})
        (folder / VALIDATION_DIR / META_FILE).write_text(meta_json(val_meta))
        meta.validation = asdict(ValidationSplit(fraction=fraction, rule=SPLIT_RULE, path=validation_path,
                                                 num_documents=val.num_documents, num_tokens=val.num_tokens,
                                                 sha256=val.sha256))
    (folder / META_FILE).write_text(meta_json(meta))
    return meta


def check_counts(sources: List[str], fraction: float, documents: int, held_out_documents: int) -> None:
    """A preparation that leaves training, or with a fraction validation, without a document is refused."""
    if documents == 0:
        held = f" (all {held_out_documents} were held out for validation)" if held_out_documents else ""
        raise ValueError(f"data sources {sources} yielded no documents for training{held} (documents without "
                         "text are dropped)")
    if fraction > 0 and held_out_documents == 0:
        raise ValueError(f"validation fraction {fraction} held out none of the {documents} documents of {sources}; "
                         "raise it, or prepare a separate validation set and pass it as data.validation=<path>")


def prepare_token_file(out_dir: str | Path, sources: List[str], tokenizer: str = "byte",
                       bpe_vocab_size: int = 4096, validation_fraction: float = 0.0,
                       text_column: str = TEXT_COLUMN) -> ShardMeta:
    """Tokenize ``sources`` into ``out_dir`` in this process; a BPE is trained on the training documents only.
    The rename makes concurrent preparation by several nodes harmless: the output is a pure function of
    the inputs and the first finished copy wins."""
    check_fraction(validation_fraction)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        training_docs = (t for t in iter_documents(sources, text_column) if not held_out(t, validation_fraction))
        tok = make_tokenizer(tokenizer, training_docs, bpe_vocab_size)
        meta = write_dataset(tmp, iter_documents(sources, text_column), tok, validation_fraction, sources)
        check_counts(sources, validation_fraction, meta.num_documents,
                     meta.validation["num_documents"] if meta.validation else 0)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / META_FILE).exists():
                raise  # not a lost race: something else is in the way
        return read_meta(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
