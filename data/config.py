"""The data section (``data.*``): what a run trains and validates on, and how it is loaded (torch-free).

``data.path`` is a prepared dataset (docs/data.md): ``tokens.bin`` + ``meta.json``, a folder of such
shards, or another engine's token files read in place. What the files say is checked by the pre-flight
(data/checks.py); this section checks its values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from configs.keys import FRACTION, POSITIVE, Bound, key
from data.tokenizer import check_tokenizer_name

VALIDATION_CHOICES = ("none", "held_out")  # data.validation, besides the path of a prepared dataset


@dataclass
class DataSourceConfig:
    """One entry of ``data.mixture``: a prepared dataset (or a folder of shards) and its weight."""

    path: str = key("???", "a prepared dataset")
    weight: float = key(1.0, "its share of the samples", POSITIVE)


@dataclass
class DataConfig:
    path: str = key("outputs/data/pydoc-byte", "the prepared dataset (scripts/prepare_data.py builds one)")
    prepare_if_missing: bool = key(False, "build data.path from data.sources on first use (a folder named for "
                                   "its sources and tokenizer only)")
    sources: List[str] = key(["pydoc"], "what prepare_if_missing tokenizes: pydoc, stdlib, or .txt/.jsonl/.parquet "
                             "files")
    tokenizer: str = key("byte", "byte | bpe | hf:/path/to/tokenizer.json (a local file); must match the data's")
    bpe_vocab_size: int = key(4096, "the vocabulary a bpe tokenizer is trained to", Bound(257, 2**31 - 1))
    mixture: List[DataSourceConfig] = field(default_factory=list, metadata={
        "meaning": "non-empty: train on these sources, interleaved by weight (data.path is then unused)"})
    cross_document_loss: bool = key(True, "false: targets right after an EOS are ignored, so no loss crosses "
                                    "documents (attention still spans the packed window)")
    num_workers: int = key(0, "dataloader worker processes; 0 loads in the training process", Bound(0, 1024))
    prefetch_factor: int = key(2, "micro-batches each worker keeps ready (num_workers > 0)", Bound(1, 1024))
    allow_resume_changes: bool = key(False, "resume although the checkpoint's data fingerprint, seed, seq_len or "
                                     "global batch differ (logged); otherwise such a resume is refused")
    validation: str = key("none", "none | held_out (the documents the preparation kept out of data.path) | the "
                          "path of a prepared dataset with the same tokenizer; evaluated every eval.interval")
    validation_fraction: float = key(0.0, "documents prepare_if_missing holds out of data.path (data/prep/split.py)",
                                     FRACTION)

    def check(self) -> List[str]:
        out = []
        try:
            check_tokenizer_name(self.tokenizer)
        except ValueError as exc:
            out.append(str(exc))
        if str(self.validation).strip() == "held_out" and self.prepare_if_missing and not self.validation_fraction > 0:
            out.append("data.validation=held_out with data.prepare_if_missing=true needs data.validation_fraction > 0 "
                       "(the fraction of documents to hold out, e.g. 0.01)")
        return out
