"""Prepare a corpus as a folder of shards in N processes, resumable after a kill.

The plan comes first and depends only on the sources and ``shard_bytes``, never on the number of
workers: the sources' units (a built-in corpus or one file, data/prep/sources.py) are grouped in their
order into shards of at least ``shard_bytes`` of input (a built-in corpus is a shard of its own).
Shard ``k`` is the prepared dataset ``OUT/<k:06d>`` (tokens.bin + meta.json, data/formats/native.py),
so a folder of them is what ``data.path`` reads, shard after shard in name order: their tokens
concatenated are the tokens a single-process preparation of the same sources writes.

Completion: a shard is written in a temporary folder and renamed into place when its tokens are
fsynced and hashed; the rename is its completion marker. ``OUT/shards.json`` records the request
and the plan; a relaunch with the same arguments redoes only the shards not in place (a stale
temporary folder left by a killed worker is removed), and one with other arguments is refused.
Training refuses a folder whose plan lists a shard that is not in place (data/formats/native.py).

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
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Dict, List

from data.formats.native import META_FILE, PLAN_FILE, VALIDATION_DIR, read_meta
from data.formats.shard import FORMAT_VERSION
from data.prep.bpe import train_bpe
from data.prep.sources import BUILTIN_SOURCES, TEXT_COLUMN, source_units, unit_documents
from data.prep.split import check_fraction, held_out
from data.prep.writer import check_counts, write_dataset
from data.prepared import DataError
from data.tokenizer import load_tokenizer_spec

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
            _write_atomically(out / TOKENIZER_DIR, lambda d: train_bpe(texts, bpe_vocab_size).save(d))
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
    tmp = out / f"{TMP_PREFIX}{name}-{os.getpid()}"  # the pid names the worker (the kill tests read it)
    shutil.rmtree(tmp, ignore_errors=True)
    documents = (t for u in units for t in unit_documents(u, text_column))
    if os.environ.get(STALL_ENV) == name:
        documents = _stall_after_first(documents)
    write_dataset(tmp, documents, tok, fraction, units, validation_path=f"../{VALIDATION_DIR}/{name}")
    if fraction > 0:
        (out / VALIDATION_DIR).mkdir(exist_ok=True)
        shutil.rmtree(out / VALIDATION_DIR / name, ignore_errors=True)
        os.rename(tmp / VALIDATION_DIR, out / VALIDATION_DIR / name)
    os.rename(tmp, out / name)  # the completion marker


def _stall_after_first(documents):
    """Tests: the worker stops after one document, its shard unfinished, to be killed."""
    yield next(documents)
    time.sleep(3600)
    yield from documents


def _totals(out: Path, plan: List[Dict], fraction: float, sources: List[str]) -> Dict:
    metas = [read_meta(out / s["name"]) for s in plan]
    vals = [read_meta(out / VALIDATION_DIR / s["name"]) for s in plan] if fraction > 0 else []
    totals = {"shards": len(plan), "num_tokens": sum(m.num_tokens for m in metas),
              "num_documents": sum(m.num_documents for m in metas), "tokenizer": metas[0].tokenizer,
              "vocab_size": metas[0].vocab_size, "dtype": metas[0].dtype,
              "validation_documents": sum(m.num_documents for m in vals),
              "validation_tokens": sum(m.num_tokens for m in vals)}
    check_counts(sources, fraction, totals["num_documents"], totals["validation_documents"])
    return totals
