"""The tokenizer a preparation encodes with: the byte tokenizer, a published tokenizer.json, or a
byte-level BPE learnt here from the corpus's training documents (saved beside the tokens, where a run
reads it as data/tokenizer.py's BPETokenizer)."""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data.tokenizer import EOS_TEXT, BPETokenizer, check_tokenizer_name, load_tokenizer_spec


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
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
    return BPETokenizer(tok)


def make_tokenizer(name: str, texts: Iterable[str], bpe_vocab_size: int):
    """``byte``, ``hf:FILE`` or ``bpe`` (trained on ``texts`` here: consumed only then)."""
    check_tokenizer_name(name)
    return train_bpe(texts, bpe_vocab_size) if name == "bpe" else load_tokenizer_spec(name)
