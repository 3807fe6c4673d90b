"""Tokenizers that work offline: raw bytes (default), a BPE trained locally (by the preparation,
data/prep/bpe.py; read here from its saved tokenizer.json), or a published tokenizer from a local
``tokenizer.json`` (``data.tokenizer=hf:/path/to/tokenizer.json``, read with the ``tokenizers``
package; never downloaded). What a run needs of them: encode and decode, and their identity.

The tokenizer is part of the prepared dataset (``meta.json`` names it; a BPE or a file
tokenizer is saved beside the tokens as ``tokenizer.json``), so the same ids are reproduced
anywhere. ``meta.json``'s ``tokenizer_identity`` block (kind, vocab size, the sha256 of the
saved tokenizer.json) lets training refuse data made with another tokenizer than
``data.tokenizer`` (``tokenizer_mismatch``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Dict, Iterable, List, Optional

TOKENIZERS = ("byte", "bpe")  # data.tokenizer, besides hf:FILE
EOS_TEXT = "<|endoftext|>"


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; 256 is end-of-document."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        """Nothing to save: the byte tokenizer has no learned state."""


class BPETokenizer:
    """Byte-level BPE from the ``tokenizers`` package, trained on the corpus itself (data/prep/bpe.py)."""

    name = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.eos_id = tokenizer.token_to_id(EOS_TEXT)
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def load(cls, directory: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(Path(directory) / "tokenizer.json")))

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def save(self, directory: Path) -> None:
        self._tok.save(str(Path(directory) / "tokenizer.json"))


HF_PREFIX = "hf:"  # data.tokenizer=hf:/path/to/tokenizer.json
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # Hugging Face's companion file: names the special tokens
# End-of-document tokens of common published tokenizers, tried when no tokenizer_config.json names one.
KNOWN_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")


def tokenizer_kind(name: str) -> str:
    """byte | bpe | hf: the kind of a data.tokenizer value."""
    return "hf" if str(name).startswith(HF_PREFIX) else str(name)


class FileTokenizer(BPETokenizer):
    """A published tokenizer from a local tokenizer.json (Llama 3's, GPT-2's, ...). The end-of-
    document id is the ``eos_token`` of a tokenizer_config.json beside the file, else the first
    of KNOWN_EOS the vocabulary holds."""

    name = "hf"

    def __init__(self, tokenizer, path: Path):
        self._tok, self.path = tokenizer, Path(path)
        self.vocab_size = tokenizer.get_vocab_size()
        eos = _eos_from_config(self.path.parent / TOKENIZER_CONFIG)
        candidates = [eos] if eos else list(KNOWN_EOS)
        found = [(t, tokenizer.token_to_id(t)) for t in candidates if tokenizer.token_to_id(t) is not None]
        if not found:
            raise ValueError(f"{path}: cannot tell its end-of-document token (tried {candidates}); put a "
                             f"{TOKENIZER_CONFIG} with an \"eos_token\" beside it")
        self.eos_text, self.eos_id = found[0]

    @classmethod
    def from_file(cls, path: str | Path) -> "FileTokenizer":
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"data.tokenizer={HF_PREFIX}{path}: no such file (a local tokenizer.json; nothing is "
                             "downloaded)")
        return cls(Tokenizer.from_file(str(path)), path)

    @classmethod
    def load(cls, directory: Path) -> "FileTokenizer":
        return cls.from_file(Path(directory) / TOKENIZER_JSON)

    def save(self, directory: Path) -> None:
        """The file itself (byte for byte, so its hash identifies it) and its tokenizer_config.json."""
        shutil.copyfile(self.path, Path(directory) / TOKENIZER_JSON)
        if (self.path.parent / TOKENIZER_CONFIG).is_file():
            shutil.copyfile(self.path.parent / TOKENIZER_CONFIG, Path(directory) / TOKENIZER_CONFIG)


def _eos_from_config(path: Path) -> Optional[str]:
    if not path.is_file():
        return None
    eos = json.loads(path.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def check_tokenizer_name(name: str) -> None:
    if tokenizer_kind(name) == "hf":
        if not str(name)[len(HF_PREFIX):].strip():
            raise ValueError(f"data.tokenizer={name!r}: give the file, e.g. {HF_PREFIX}/models/llama3/tokenizer.json")
        return
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r} (data.tokenizer); choose one of {list(TOKENIZERS)} or "
                         f"{HF_PREFIX}/path/to/tokenizer.json")


def load_tokenizer_spec(spec: str):
    """A tokenizer that needs no training: ``byte``, ``hf:FILE``, or a folder holding a trained BPE's
    tokenizer.json (a prepared dataset's; how the sharded preparation hands its BPE to the workers)."""
    if spec == "byte":
        return ByteTokenizer()
    if tokenizer_kind(spec) == "hf":
        check_tokenizer_name(spec)
        return FileTokenizer.from_file(str(spec)[len(HF_PREFIX):])
    if (Path(spec) / TOKENIZER_JSON).is_file():
        return BPETokenizer.load(Path(spec))
    raise ValueError(f"tokenizer {spec!r}: expected byte, {HF_PREFIX}/path/to/tokenizer.json or a folder with a "
                     f"trained {TOKENIZER_JSON}")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tokenizer_identity(tok, file: Optional[Path]) -> Dict:
    """meta.json's ``tokenizer_identity`` block: what training compares with data.tokenizer. ``file``:
    the tokenizer.json that holds ``tok``, whose sha256 identifies it (the byte tokenizer has none)."""
    return {"kind": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "sha256": sha256_of(file) if file is not None and Path(file).is_file() else None,
            "file": str(Path(tok.path).resolve()) if isinstance(tok, FileTokenizer) else None}


def tokenizer_mismatch(configured: str, prepared: str, identity: Optional[Dict], where: str) -> Optional[str]:
    """Why data at ``where``, prepared with tokenizer ``prepared`` (meta.json: kind, and the
    ``tokenizer_identity`` block when present), cannot be trained with data.tokenizer=``configured``."""
    kind = tokenizer_kind(configured)
    vocab = f" (vocab {identity['vocab_size']})" if identity else ""
    if kind != prepared:
        return (f"data.tokenizer={configured} but {where} was prepared with the {prepared} tokenizer{vocab}: set "
                f"data.tokenizer to the data's tokenizer, or prepare the data again with --tokenizer {configured}")
    if kind != "hf":
        return None
    path = Path(str(configured)[len(HF_PREFIX):])
    if not path.is_file():
        return f"data.tokenizer={configured}: no such file (the tokenizer.json {where} is checked against)"
    got, want = sha256_of(path), (identity or {}).get("sha256")
    if got != want:
        return (f"data.tokenizer={configured} (sha256 {got[:16]}...) is not the tokenizer {where} was prepared with "
                f"(sha256 {str(want)[:16]}..., from {(identity or {}).get('file')}); point data.tokenizer at that "
                "file, or prepare the data again with this one")
    return None


# -- the byte tokenizer as a Hugging Face tokenizer.json (for exports and datatrove: other tools can then encode) --
# What tokenizer_config.json must say beside it for transformers to give the same ids: transformers registers the
# eos_token it names as a special token, which it would then match in the text; this keeps it from doing so.
BYTE_TOKENIZER_CONFIG = {"split_special_tokens": True}


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what the ByteLevel pre-tokenizer emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json():
    """A ``tokenizers.Tokenizer`` equal to ByteTokenizer on every string: id b is byte b (no merges), id 256
    is EOS and decodes to nothing, as ByteTokenizer drops it.

    EOS is in the vocabulary only, not an added (special) token: ``tokenizers`` matches every added token
    in the text before anything else, so the 13 characters ``<|endoftext|>`` inside a document would
    become id 256, where ByteTokenizer gives their 13 bytes. Nothing produces id 256 from text here: the
    model has no merges, so only the post-processor of whoever appends EOS (this project's preparation,
    datatrove's DocumentTokenizer, which finds it with ``token_to_id``) writes it. transformers needs
    BYTE_TOKENIZER_CONFIG in the tokenizer_config.json beside it (an export writes it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    vocab[EOS_TEXT] = ByteTokenizer.eos_id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    # EOS decodes to nothing (ByteTokenizer.decode drops ids >= 256): a byte token is one character, so
    # only EOS's own token holds the whole string the Replace looks for.
    tok.decoder = decoders.Sequence([decoders.Replace(EOS_TEXT, ""), decoders.ByteLevel()])
    return tok
