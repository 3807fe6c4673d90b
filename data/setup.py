"""Open the prepared dataset for training, building the built-in corpus on first use."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from data.token_file import META_FILE, TokenFile, prepare_token_file

log = logging.getLogger("trainer")


def open_dataset(data_cfg, world, model_vocab_size: int) -> TokenFile:
    path = Path(data_cfg.path)
    if data_cfg.prepare_if_missing and not (path / META_FILE).exists():
        # One process per node builds it (the output is deterministic and renamed into
        # place atomically, so nodes sharing a file system may race harmlessly).
        if world.local_rank == 0:
            log.info("preparing %s from %s (tokenizer %s)", path, list(data_cfg.sources), data_cfg.tokenizer)
            prepare_token_file(path, list(data_cfg.sources), data_cfg.tokenizer, data_cfg.bpe_vocab_size)
        if dist.is_initialized():
            dist.barrier()
    token_file = TokenFile(path)
    meta = token_file.meta
    if meta.vocab_size > model_vocab_size:
        raise ValueError(
            f"dataset {path} uses tokenizer {meta.tokenizer} with vocab size {meta.vocab_size}, larger than "
            f"model.vocab_size={model_vocab_size}; raise model.vocab_size to at least {meta.vocab_size}"
        )
    return token_file
