"""The held-out validation split: which documents the preparation step keeps out of training.

A document is held out when the first 8 bytes of the sha256 of its UTF-8 text, read as a
number in [0, 1), fall below the fraction. The rule looks at the text alone, so a document
stays on the same side when the corpus grows or its order changes, and duplicates of a
document land on the same side (no copy of a validation document is trained on).

The held-out documents are written as a prepared dataset of their own in the ``validation``
sub-folder (``tokens.bin``, ``meta.json``, the tokenizer), and the parent's ``meta.json``
records the split in its ``validation`` block (``ValidationSplit``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

SPLIT_RULE = "sha256(utf-8 text)[:8] / 2**64 < fraction"


@dataclass
class ValidationSplit:
    """The ``validation`` block of a prepared dataset's meta.json."""

    fraction: float  # the requested fraction of documents
    rule: str  # how a document is chosen (SPLIT_RULE)
    path: str  # the sub-folder holding the held-out documents, relative to the dataset
    num_documents: int
    num_tokens: int
    sha256: str  # of the validation tokens.bin


def check_fraction(fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation fraction {fraction} must be in [0, 1) (data.validation_fraction, "
                         "--validation-fraction; 0 holds nothing out)")


def held_out(text: str, fraction: float) -> bool:
    """True when the document ``text`` belongs to the validation split of ``fraction``."""
    if fraction <= 0.0:
        return False
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
