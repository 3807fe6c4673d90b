"""Random documents for the tokenizer property tests: characters of every UTF-8 length, whitespace, control
characters, the end-of-text literal whole and in pieces, and other tokenizers' special tokens."""

from __future__ import annotations

import random

from data.tokenizer import EOS_TEXT

PIECES = [EOS_TEXT, "<|", "|>", "endoftext", "<|endoftext", "endoftext|>", EOS_TEXT * 2, "<|begin_of_text|>",
          "<|end_of_text|>", "</s>", "<s>", "\n", "\r\n", "\t", " ", "  ", "\u00a0", "\u3000", "\x00", "\x1c", "\x7f"]


def random_text(rng: random.Random) -> str:
    """A document of 0 to 12 random parts (possibly empty)."""
    parts = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.randrange(6)
        if kind == 0:
            parts.append(rng.choice(PIECES))
        elif kind == 1:
            parts.append("".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(1, 8))))
        elif kind == 2:
            parts.append("".join(chr(rng.randint(0x80, 0x7FF)) for _ in range(rng.randint(1, 4))))
        elif kind == 3:  # the rest of the basic plane, surrogates excepted (no UTF-8 for them)
            parts.append("".join(chr(rng.choice([rng.randint(0x800, 0xD7FF), rng.randint(0xE000, 0xFFFF)]))
                                 for _ in range(rng.randint(1, 4))))
        elif kind == 4:
            parts.append("".join(chr(rng.randint(0x10000, 0x10FFFF)) for _ in range(rng.randint(1, 3))))
        else:
            parts.append("".join(chr(rng.randint(0, 31)) for _ in range(rng.randint(1, 3))))
    return "".join(parts)
