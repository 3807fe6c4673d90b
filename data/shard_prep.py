"""Prepare a corpus as a folder of shards in N processes, resumable after a kill.

The plan comes first and depends only on the sources and ``shard_bytes``, never on the number of
workers: the sources' units (a built-in corpus or one file, data/sources.py) are grouped in their
order into shards of at least ``shard_bytes`` of input (a built-in corpus is a shard of its own).
Shard ``k`` is the prepared dataset ``OUT/<k:06d>`` (tokens.bin + meta.json, data/token_file.py),
so a folder of them is what ``data.path`` reads, shard after shard in name order: their tokens
concatenated are the tokens a single-process preparation of the same sources writes.

Completion: a shard is written in a temporary folder and renamed into place when its tokens are
fsynced and hashed; the rename is its completion marker. ``OUT/shards.json`` records the request
and the plan; a relaunch with the same arguments redoes only the shards not in place (a stale
temporary folder left by a killed worker is removed), and one with other arguments is refused.
Training refuses a folder whose plan lists a shard that is not in place (data/token_file.py).

With a validation fraction, shard ``k``'s held-out documents go to ``OUT/validation/<k:06d>``,
renamed into place before the training shard (whose rename still marks the pair complete).
A BPE is trained once, in this process, on the training documents, and saved in
``OUT/.tokenizer`` before the plan is written; the workers load it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Dict, List

import numpy as np

from data.prepared import META_FILE, PLAN_FILE, DataError
from data.sources import BUILTIN_SOURCES, TEXT_COLUMN, source_units, unit_documents
from data.split import SPLIT_RULE, VALIDATION_DIR, ValidationSplit, check_fraction, held_out
from data.token_file import FORMAT_VERSION, TokenFileMeta, TokenWriter, meta_json, read_meta
from data.tokenizer import BPETokenizer, load_tokenizer_spec, tokenizer_identity

TOKENIZER_DIR = ".tokenizer"  # a BPE trained once for all shards
TMP_PREFIX = ".tmp-"
STALL_ENV = "LLM_TRAINER_PREPARE_STALL"  # tests: the worker of this shard stops after one document, to be killed
DEFAULT_SHARD_BYTES = 256 << 20


def plan_shards(sources: List[str], shard_bytes: int) -> List[List[str]]:
    """Units grouped in order into shards of >= ``shard_bytes`` of input; a built-in corpus alone."""
    if shard_bytes < 1:
        raise ValueError(f"--shard-bytes {shard_bytes} must be >= 1 (input bytes per shard; default "
                         f"{DEFAULT_SHARD_BYTES})")
    shards, current, size = [], [], 0
    for unit in source_units(sources):
        if unit in BUILTIN_SOURCES:
            shards += [current] if current else []
            shards.append([unit])
            current, size = [], 0
            continue
        current.append(unit)
        size += os.path.getsize(unit)
        if size >= shard_bytes:
            shards.append(current)
            current, size = [], 0
    return shards + ([current] if current else [])


def shard_name(index: int) -> str:
    return f"{index:06d}"


def prepare_shards(out: str | Path, sources: List[str], tokenizer: str = "byte", bpe_vocab_size: int = 4096,
                   validation_fraction: float = 0.0, text_column: str = TEXT_COLUMN, workers: int = 1,
                   shard_bytes: int = DEFAULT_SHARD_BYTES, log=print) -> Dict:
    """Prepare (or finish preparing) ``out``; returns the totals. Raises on a changed request."""
    check_fraction(validation_fraction)
    if workers < 1:
        raise ValueError(f"--workers {workers} must be >= 1 (processes that tokenize shards)")
    out = Path(out)
    request = {"format_version": FORMAT_VERSION, "sources": list(sources), "tokenizer": tokenizer,
               "bpe_vocab_size": bpe_vocab_size if tokenizer == "bpe" else None,
               "validation_fraction": validation_fraction, "text_column": text_column, "shard_bytes": shard_bytes}
    plan = [{"name": shard_name(i), "units": units} for i, units in enumerate(plan_shards(sources, shard_bytes))]
    if (out / PLAN_FILE).is_file():
        _check_same_request(out, json.loads((out / PLAN_FILE).read_text()), request, plan)
    else:
        out.mkdir(parents=True, exist_ok=True)
        if tokenizer == "bpe":  # trained once on the training documents, before any shard is written
            texts = (t for u in source_units(sources) for t in unit_documents(u, text_column)
                     if not held_out(t, validation_fraction))
            _write_atomically(out / TOKENIZER_DIR, lambda d: BPETokenizer.train(texts, bpe_vocab_size).save(d))
        tmp = out / f"{TMP_PREFIX}{PLAN_FILE}"
        tmp.write_text(json.dumps({**request, "shards": plan}, indent=1) + "\n")
        os.replace(tmp, out / PLAN_FILE)
    _remove_stale(out)
    spec = str(out / TOKENIZER_DIR) if tokenizer == "bpe" else tokenizer
    todo = [s for s in plan if not (out / s["name"] / META_FILE).is_file()]
    log(f"{out}: {len(plan)} shard(s) planned, {len(plan) - len(todo)} already complete, {len(todo)} to do "
        f"with {workers} worker(s)")
    jobs = [(str(out), s["name"], s["units"], spec, text_column, validation_fraction) for s in todo]
    try:
        if workers == 1 or len(jobs) <= 1:
            list(map(_prepare_shard, jobs))
        else:
            # fork where there is one: a worker starts in milliseconds (it tokenizes only; no threads it inherits run)
            context = get_context("fork" if "fork" in get_all_start_methods() else "spawn")
            with ProcessPoolExecutor(workers, mp_context=context) as pool:
                list(pool.map(_prepare_shard, jobs))
    except BrokenProcessPool as e:
        raise RuntimeError(f"a worker preparing {out} died ({e}); the shards it finished are kept: run the same "
                           "command again to prepare only the unfinished ones") from e
    return _totals(out, plan, validation_fraction, sources)


def _check_same_request(out: Path, recorded: Dict, request: Dict, plan: List[Dict]) -> None:
    changed = [f"{k}: {recorded.get(k)!r} -> {v!r}" for k, v in request.items() if recorded.get(k) != v]
    if not changed and recorded["shards"] != plan:
        changed = ["the source files (their list or sizes) changed since the plan was made"]
    if changed:
        raise DataError(f"{out} holds a preparation made with other arguments ({'; '.join(changed)}); run the "
                        "original command to finish it, or pass --force to start again")


def _remove_stale(out: Path) -> None:
    """Temporary folders a killed worker left behind (only one preparation may write ``out`` at a time)."""
    for parent in (out, out / VALIDATION_DIR):
        for stale in parent.glob(f"{TMP_PREFIX}*") if parent.is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


def _write_atomically(final: Path, fill) -> None:
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    shutil.rmtree(final, ignore_errors=True)  # a validation shard of a killed attempt, written again identically
    os.rename(tmp, final)


def _prepare_shard(job) -> None:
    """One shard, in a worker: tokenize its units, write validation then training, each renamed into place."""
    out, name, units, spec, text_column, fraction = job
    out, tok = Path(out), load_tokenizer_spec(spec)
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    tmp = out / f"{TMP_PREFIX}{name}-{os.getpid()}"  # the pid names the worker (the kill tests read it)
    shutil.rmtree(tmp, ignore_errors=True)
    split = {False: TokenWriter(tmp, dtype), True: TokenWriter(tmp / VALIDATION_DIR, dtype)}
    for text in (t for u in units for t in unit_documents(u, text_column)):
        ids = tok.encode(text)
        ids.append(tok.eos_id)
        split[held_out(text, fraction)].write(ids)
        if os.environ.get(STALL_ENV) == name:
            split[False].file.flush()
            time.sleep(3600)
    train, val = split[False].close(), split[True].close()
    tok.save(tmp)
    meta = TokenFileMeta(format_version=FORMAT_VERSION, tokenizer=tok.name, vocab_size=tok.vocab_size,
                         eos_id=tok.eos_id, dtype=np.dtype(dtype).name, num_tokens=train.num_tokens,
                         num_documents=train.num_documents, sha256=train.sha256, sources=list(units),
                         tokenizer_identity=tokenizer_identity(tok, tmp))
    if fraction > 0:
        tok.save(tmp / VALIDATION_DIR)
        val_meta = TokenFileMeta(**{**asdict(meta), "num_tokens": val.num_tokens,
                                    "num_documents": val.num_documents, "sha256": val.sha256})
        (tmp / VALIDATION_DIR / META_FILE).write_text(meta_json(val_meta))
        meta.validation = asdict(ValidationSplit(fraction=fraction, rule=SPLIT_RULE,
                                                 path=f"../{VALIDATION_DIR}/{name}", num_documents=val.num_documents,
                                                 num_tokens=val.num_tokens, sha256=val.sha256))
        (out / VALIDATION_DIR).mkdir(exist_ok=True)
        shutil.rmtree(out / VALIDATION_DIR / name, ignore_errors=True)
        os.rename(tmp / VALIDATION_DIR, out / VALIDATION_DIR / name)
    else:
        shutil.rmtree(tmp / VALIDATION_DIR)
    (tmp / META_FILE).write_text(meta_json(meta))
    os.rename(tmp, out / name)  # the completion marker


def _totals(out: Path, plan: List[Dict], fraction: float, sources: List[str]) -> Dict:
    metas = [read_meta(out / s["name"]) for s in plan]
    vals = [read_meta(out / VALIDATION_DIR / s["name"]) for s in plan] if fraction > 0 else []
    totals = {"shards": len(plan), "num_tokens": sum(m.num_tokens for m in metas),
              "num_documents": sum(m.num_documents for m in metas), "tokenizer": metas[0].tokenizer,
              "vocab_size": metas[0].vocab_size, "dtype": metas[0].dtype,
              "validation_documents": sum(m.num_documents for m in vals),
              "validation_tokens": sum(m.num_tokens for m in vals)}
    if totals["num_documents"] == 0:
        raise ValueError(f"data sources {sources} yielded no documents for training")
    if fraction > 0 and totals["validation_documents"] == 0:
        raise ValueError(f"validation fraction {fraction} held out none of the {totals['num_documents']} documents "
                         f"of {sources}; raise it, or prepare a separate validation set (data.validation=<path>)")
    return totals
