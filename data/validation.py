"""Which prepared dataset a run validates on (``data.validation``), and the checks that it fits.

``none``: no validation. ``held_out``: the documents the preparation step kept out of
``data.path`` (data/prep/split.py; ``<data.path>/validation``). Anything else: the path of a
separately prepared dataset. Either way it must use the training data's tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from data.config import VALIDATION_CHOICES
from data.formats.native import META_FILE, VALIDATION_DIR
from data.formats.registry import is_prepared
from data.prepared import prepare_command
from data.token_source import TokenSource
from data.tokenizer import TOKENIZER_JSON

NONE, HELD_OUT = VALIDATION_CHOICES


def validation_path(data_cfg) -> Optional[Path]:
    """The prepared dataset ``data.validation`` names (None for ``none``)."""
    choice = str(data_cfg.validation).strip()
    if choice == NONE:
        return None
    if choice == HELD_OUT:
        return Path(data_cfg.path) / VALIDATION_DIR
    return Path(choice)


def _reprepare(data_cfg) -> str:
    return prepare_command(data_cfg.path, data_cfg.sources, data_cfg.tokenizer,
                           validation_fraction=data_cfg.validation_fraction or 0.01, force=True)


def validation_problem(data_cfg, prepared_yet: bool = True) -> Optional[str]:
    """Why ``data.validation`` cannot be used (None when it can). ``prepared_yet=False``: data.path
    will be built by prepare_if_missing, so a held-out split it lacks is not a problem yet."""
    choice = str(data_cfg.validation).strip()
    if choice == NONE:
        return None
    if choice == HELD_OUT:
        if data_cfg.mixture:
            return ("data.validation=held_out names the split held out of data.path, but this run trains on "
                    "data.mixture; prepare a validation set and pass its path: data.validation=<path>")
        if not prepared_yet:
            return None
        path = validation_path(data_cfg)
        if not is_prepared(path):  # a prepared dataset, or a sharded preparation's folder of validation shards
            return (f"data.validation=held_out, but {data_cfg.path} was prepared without a held-out split "
                    f"(no {path}/{META_FILE}); prepare it again with one: {_reprepare(data_cfg)}  "
                    "(or set data.validation=none, or data.validation=<path of a prepared dataset>)")
        return None
    if not is_prepared(Path(choice)):
        return (f"no prepared dataset at data.validation={choice}; prepare it with: "
                f"{prepare_command(choice, ['<sources>'], data_cfg.tokenizer)}  (or set data.validation=none)")
    return None


def _tokenizer_file(dataset: Path) -> Optional[bytes]:
    path = dataset / TOKENIZER_JSON
    return path.read_bytes() if path.is_file() else None


def open_validation(data_cfg, seq_len: int, training: TokenSource) -> Optional[TokenSource]:
    """The validation source cut into ``seq_len`` windows, or None for ``data.validation=none``.
    It must use the tokenizer of ``training`` (the first training source): the same name, vocab
    size and EOS id, and the same saved tokenizer file (a trained BPE) if there is one."""
    path = validation_path(data_cfg)
    if path is None:
        return None
    problem = validation_problem(data_cfg)
    if problem:
        raise ValueError(problem)
    source = TokenSource(path, seq_len, data_cfg.tokenizer)
    same_file = _tokenizer_file(source.shards[0].path) == _tokenizer_file(training.shards[0].path)
    if source.tokenizer != training.tokenizer or not same_file:
        what = f"(name, vocab, eos) {source.tokenizer}" if source.tokenizer != training.tokenizer else \
            f"another {TOKENIZER_JSON}"
        raise ValueError(
            f"data.validation={data_cfg.validation} ({path}) uses tokenizer {what}, the training data "
            f"{training.path} uses {training.tokenizer}: token ids would mean different text; validate on a set "
            "prepared with the training data's tokenizer (data.validation=held_out uses the same one)")
    return source
