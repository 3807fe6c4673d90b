"""What the pre-flight (trainer/preflight.py) asks of the data's files, before anything is built (torch-free):
data.path is a prepared dataset (or one prepare_if_missing may build), its meta.json fits the model and the
tokenizer, the validation split holds enough sequences. The section's values check themselves (data/config.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from data.formats.native import META_FILE
from data.formats.registry import is_prepared
from data.prepared import prepare_command, prepared_name
from data.tokenizer import check_tokenizer_name, tokenizer_mismatch
from data.validation import validation_path, validation_problem


def file_problems(cfg) -> List[str]:
    """data.path and data.validation, for a run that trains (not a dry run)."""
    d = cfg.data
    if cfg.dry_run:
        return []
    out = []
    try:  # with an unknown tokenizer (reported already), the advice would name it in a prepare command
        check_tokenizer_name(d.tokenizer)
        problem = data_path_problem(d)
        if problem:
            out.append(problem)
    except ValueError:
        pass
    prepared_yet = not (d.prepare_if_missing and not is_prepared(Path(d.path)))
    problem = validation_problem(d, prepared_yet=prepared_yet)
    if problem:
        out.append(problem)
    elif not out:
        out += meta_problems(cfg)
    return out


def _meta(path: Path) -> Optional[dict]:
    """The meta.json of a prepared dataset (the first shard's for a folder of shards), or None."""
    found = [path / META_FILE] if (path / META_FILE).is_file() else sorted(path.glob(f"*/{META_FILE}"))
    try:
        return json.loads(found[0].read_text()) if found else None
    except (OSError, ValueError):
        return None


def meta_problems(cfg) -> List[str]:
    """What the prepared data's meta.json says against the config, before anything is built: the tokenizer,
    the vocabulary against model.vocab_size, the validation set's tokenizer and size against eval.batches."""
    d, out = cfg.data, []
    paths = [Path(m.path) for m in d.mixture] or [Path(d.path)]
    metas = [(p, _meta(p)) for p in paths]
    for path, meta in metas:
        if meta is None and d.prepare_if_missing and not d.mixture and d.tokenizer in ("byte", "bpe"):
            meta = {"tokenizer": d.tokenizer, "vocab_size": 257 if d.tokenizer == "byte" else d.bpe_vocab_size}
        if meta is None:
            continue
        problem = tokenizer_mismatch(d.tokenizer, meta["tokenizer"], meta.get("tokenizer_identity"), str(path))
        if problem:
            out.append(problem)
        elif meta["vocab_size"] > cfg.model.vocab_size:
            out.append(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of the data at "
                       f"{path} ({meta['tokenizer']} tokenizer, vocab size {meta['vocab_size']}); raise "
                       f"model.vocab_size to at least {meta['vocab_size']}")
    if out or metas[0][1] is None or str(d.validation).strip() == "none" or not cfg.eval.interval > 0:
        return out
    vpath = validation_path(d)
    vmeta, train = _meta(vpath), metas[0][1]
    if vmeta is None:
        return out
    ident = lambda m: (m["tokenizer"], m["vocab_size"], m["eos_id"])  # noqa: E731
    if ident(vmeta) != ident(train):
        out.append(f"data.validation: {vpath} uses tokenizer (name, vocab, eos) {ident(vmeta)}, the training data "
                   f"{ident(train)}; prepare the validation set with the training data's tokenizer")
        return out
    t = cfg.training
    if not (t.seq_len >= 1 and t.global_batch_size >= 1):
        return out  # reported by their bounds (a seq_len of 0 would divide by zero here)
    windows = max(0, (vmeta["num_tokens"] - 1) // cfg.training.seq_len)
    needed = cfg.eval.batches * cfg.training.global_batch_size
    if (vpath / META_FILE).is_file() and needed > windows:  # a folder of shards: counted when it is opened
        out.append(f"eval.batches={cfg.eval.batches} x training.global_batch_size={cfg.training.global_batch_size} "
                   f"= {needed} validation sequences, but the validation set {vpath} holds about {windows} of "
                   f"seq_len {cfg.training.seq_len} + 1; lower eval.batches to at most "
                   f"{windows // cfg.training.global_batch_size} or validate on more text")
    return out


def data_path_problem(data_cfg) -> Optional[str]:
    """Why ``data.path`` cannot be used (None when it can). prepare_if_missing builds only a folder
    named for its sources and tokenizer, so a mistyped path stops instead of building there."""
    if data_cfg.mixture:
        missing = [m.path for m in data_cfg.mixture if not is_prepared(Path(m.path))]
        return (f"data.mixture: no prepared dataset at {missing}; prepare each with: "
                f"{prepare_command('<path>', data_cfg.sources, data_cfg.tokenizer)}") if missing else None
    path = Path(data_cfg.path)
    if is_prepared(path):
        return None
    name = prepared_name(data_cfg.sources, data_cfg.tokenizer)
    how = f"prepare it with: {prepare_command(path, data_cfg.sources, data_cfg.tokenizer)}"
    if not data_cfg.prepare_if_missing:
        return f"no prepared dataset at data.path={path}; {how}  (or set data.prepare_if_missing=true)"
    if path.name != name:
        return (f"no prepared dataset at data.path={path}, and data.prepare_if_missing builds only a folder named "
                f"for its sources and tokenizer ({name!r}), so that a mistyped path is not filled with "
                f"{list(data_cfg.sources)}. Check the path, or {how}")
    return None
