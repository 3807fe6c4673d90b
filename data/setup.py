"""Build the data pipeline train.py uses from the ``data`` and ``training`` config."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Tuple

from data.batching import BatchPlan
from data.formats.registry import is_prepared
from data.order import SampleOrder
from data.pipeline import DataPipeline
from data.prepared import DataError, run_preparation
from data.state import MEANING_FIELDS
from data.token_source import TokenSource
from data.tokenizer import tokenizer_mismatch
from parallel import collectives

log = logging.getLogger("trainer")


def prepare_if_missing(data_cfg, world) -> None:
    """Build ``data.path`` from ``data.sources`` on first use, when asked to, by running the command
    the advice prints (scripts/prepare_data.py) in a process of its own.

    One process per node builds it if that node does not see it yet (the output is deterministic and
    renamed into place atomically, so nodes sharing a file system may race harmlessly: a preparation
    that failed is a problem only while the data is still missing). Every rank then enters one agreement,
    whatever it saw: whether a rank enters a collective is decided by the config alone, never by what one
    rank found on disk (a node that looked after another had finished would skip it and pair its next
    collective with its peers'). A failure on any node is the same DataError on every rank."""
    if not data_cfg.prepare_if_missing or data_cfg.mixture:
        return
    path, problem = Path(data_cfg.path), None
    if world.local_rank == 0 and not is_prepared(path):
        log.info("preparing %s from %s (tokenizer %s, validation fraction %g)", path, list(data_cfg.sources),
                 data_cfg.tokenizer, data_cfg.validation_fraction)
        options = {"bpe_vocab_size": data_cfg.bpe_vocab_size} if data_cfg.tokenizer == "bpe" else {}
        if data_cfg.validation_fraction > 0:
            options["validation_fraction"] = data_cfg.validation_fraction
        try:
            log.info("%s", run_preparation(path, list(data_cfg.sources), data_cfg.tokenizer, **options).strip())
        except DataError as exc:
            problem = None if is_prepared(path) else str(exc)
    problem = collectives.agree_on_problems(problem)
    if problem:
        raise collectives.agreed(DataError(problem))


def open_sources(data_cfg, seq_len: int) -> Tuple[List[TokenSource], List[float]]:
    """``data.mixture`` entries (path, weight), or ``data.path`` alone with weight 1."""
    entries = [(m.path, float(m.weight)) for m in data_cfg.mixture] or [(data_cfg.path, 1.0)]
    sources = [TokenSource(path, seq_len, data_cfg.tokenizer) for path, _ in entries]
    first = sources[0]
    for source in sources[1:]:
        if source.tokenizer != first.tokenizer:
            raise ValueError(
                f"data.mixture sources use different tokenizers: {first.path} has (name, vocab, eos) "
                f"{first.tokenizer}, {source.path} has {source.tokenizer}; prepare them with the same tokenizer"
            )
    return sources, [w for _, w in entries]


def build_data_pipeline(data_cfg, seq_len: int, seed: int, plan: BatchPlan, dp_rank: int, world,
                        model_vocab_size: int, allow_global_batch_change: bool = False) -> DataPipeline:
    """The pipeline of data-parallel rank ``dp_rank``. A resume may change the global batch
    when ``allow_global_batch_change`` (recovery.allow_global_batch_change), and anything
    that changes the sample order when ``data.allow_resume_changes``."""
    prepare_if_missing(data_cfg, world)
    sources, weights = open_sources(data_cfg, seq_len)
    for source in sources:  # data made with another tokenizer than data.tokenizer is refused
        meta = source.shards[0].meta
        problem = tokenizer_mismatch(data_cfg.tokenizer, meta.tokenizer, meta.tokenizer_identity, str(source.path))
        if problem:
            raise DataError(problem)
    tokenizer, vocab_size, eos_id = sources[0].tokenizer
    if vocab_size > model_vocab_size:
        raise DataError(
            f"dataset {sources[0].path} uses tokenizer {tokenizer} with vocab size {vocab_size}, larger than "
            f"model.vocab_size={model_vocab_size}; raise model.vocab_size to at least {vocab_size}"
        )
    order = SampleOrder(sources, weights, seed)
    allowed = MEANING_FIELDS if data_cfg.allow_resume_changes else (
        ("global_batch_size",) if allow_global_batch_change else ())
    for source, quota in zip(sources, order.schedule.quotas):
        log.info("data source %s: %d shard(s), %d tokens, %d sequences of %d (+1), %d of every %d samples",
                 source.path, len(source.shards), source.num_tokens, source.num_sequences, seq_len, quota,
                 order.schedule.block_size)
    return DataPipeline(
        order, plan, dp_rank, seq_len=seq_len, eos_id=eos_id, cross_document_loss=data_cfg.cross_document_loss,
        num_workers=data_cfg.num_workers, prefetch_factor=data_cfg.prefetch_factor,
        pin_memory=world.device.type == "cuda", allowed_resume_changes=allowed,
    )
