"""Tokenizers that work offline: raw bytes (default) or a BPE trained locally.

The tokenizer is part of the prepared dataset (``meta.json`` names it and a trained BPE is
saved beside the tokens as ``tokenizer.json``), so the same ids are reproduced anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List

from configs.constants import TOKENIZERS

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
    """Byte-level BPE from the ``tokenizers`` package, trained on the corpus itself."""

    name = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.eos_id = tokenizer.token_to_id(EOS_TEXT)
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

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


def check_tokenizer_name(name: str) -> None:
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r} (data.tokenizer); choose one of {list(TOKENIZERS)}")


def load_tokenizer(dataset_dir: str | Path):
    """The tokenizer a prepared dataset was made with."""
    meta = json.loads((Path(dataset_dir) / "meta.json").read_text())
    check_tokenizer_name(meta["tokenizer"])
    return ByteTokenizer() if meta["tokenizer"] == "byte" else BPETokenizer.load(Path(dataset_dir))
