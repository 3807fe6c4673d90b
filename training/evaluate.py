"""Validation loss: the mean token loss of fixed held-out batches, the same at every layout.

The batches are global samples ``[0, eval.batches x G)`` of an order of the validation windows whose
seed is fixed (EVAL_ORDER_SEED, not the run's), so runs with different seeds are compared on the same
windows. Each data-parallel rank reads its slice of every batch in micro-batches (data/batching.py);
the summed token losses and target counts are all-reduced in float64 and divided once, so the result is
the mean over the whole set whatever the layout. It runs when ``due``: every ``eval.interval`` steps,
after the last step and before every save (each manifest records the validation loss of its weights,
which ``checkpoint.best_metric=val_loss`` ranks by).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from data.batching import BatchPlan, SampleRange, rank_micro_batches
from data.dataset import IGNORE_INDEX, MicroBatchDataset
from data.order import SampleOrder
from data.token_source import TokenSource
from data.validation import open_validation
from parallel import collectives
from training.config import EvalConfig
from training.step import global_value, token_loss_sum, vocab_parallel_loss

log = logging.getLogger("trainer")

EVAL_ORDER_SEED = 0  # the validation windows' order; fixed, so every run sees the same batches


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean token loss over every evaluated target token
    tokens: int  # target tokens evaluated, over all ranks
    seconds: float


class Evaluator:
    def __init__(self, model: torch.nn.Module, source: TokenSource, plan: BatchPlan, dp_rank: int, *,
                 batches: int, interval: int, total_steps: int, eos_id: int, device: torch.device,
                 dp_group: Optional[dist.ProcessGroup] = None, autocast: Optional[Callable] = None,
                 cross_document_loss: bool = True, loss_parallel: bool = False):
        needed = batches * plan.global_batch_size
        if needed > source.num_sequences:
            raise ValueError(
                f"eval.batches={batches} x training.global_batch_size={plan.global_batch_size} = {needed} validation "
                f"sequences, but the validation set {source.path} holds {source.num_sequences} sequences of "
                f"seq_len {source.seq_len} + 1 ({source.num_tokens:,} tokens); lower eval.batches to at most "
                f"{max(source.num_sequences // plan.global_batch_size, 0)} or validate on more text")
        self.model, self.device, self.dp_group = model, device, dp_group
        self.autocast, self.loss_parallel = autocast, loss_parallel
        self.interval, self.total_steps = interval, total_steps
        self.source = source
        self.dataset = MicroBatchDataset(SampleOrder([source], [1.0], EVAL_ORDER_SEED), eos_id, cross_document_loss)
        self.micro_batches: List[SampleRange] = [
            r for b in range(batches) for r in rank_micro_batches(plan, b * plan.global_batch_size, dp_rank)]
        self.num_sequences = needed

    def due(self, step: int, saving: bool = False) -> bool:
        """Evaluate after 1-based ``step``? Every ``interval`` steps, after the last step, before a save."""
        return step % self.interval == 0 or step == self.total_steps or saving

    def sequence_ids(self) -> np.ndarray:
        """Window ids of every evaluated sequence, over all ranks (what a test compares)."""
        return self.dataset.order.sequence_ids(np.arange(self.num_sequences))

    def evaluate(self) -> EvalResult:
        """Every rank calls it (collectives inside); every rank gets the same result."""
        start = time.perf_counter()
        totals = torch.stack(loss_sum(self.model, (self.dataset[s] for s in self.micro_batches), self.device,
                                      self.autocast, self.loss_parallel))
        if self.dp_group is not None:
            collectives.all_reduce(totals, self.dp_group)
        loss_total, tokens = totals.tolist()
        if tokens == 0:
            raise ValueError(f"the validation batches of {self.source.path} have no target tokens (all ignored)")
        return EvalResult(loss=loss_total / tokens, tokens=int(tokens), seconds=time.perf_counter() - start)


@torch.no_grad()
def loss_sum(model: torch.nn.Module, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]], device: torch.device,
             autocast: Optional[Callable] = None, loss_parallel: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The summed token loss of ``batches`` ((inputs, targets) pairs) and their target count, both float64 on
    ``device``, with no host sync. In eval mode (no dropout), no random number drawn: the training trajectory
    does not change. Every rank calls it (under TP, collectives inside)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast() if autocast is not None else contextlib.nullcontext():
                logits = model(inputs)
            with vocab_parallel_loss() if loss_parallel else contextlib.nullcontext():
                total += global_value(token_loss_sum(logits, targets)).double()
            tokens += (targets != IGNORE_INDEX).sum()
            del logits
    finally:
        model.train(was_training)
    return total, tokens


def build_evaluator(e: EvalConfig, data_cfg, seq_len: int, steps: int, model: torch.nn.Module, data,
                    plan: BatchPlan, dp_rank: int, device: torch.device, dp_group=None, autocast=None,
                    loss_parallel: bool = False) -> Optional[Evaluator]:
    """The run's evaluator from ``eval.*`` (``e``) and ``data.validation``; None when it does not evaluate.
    ``data``: the training DataPipeline (its first source gives the tokenizer to match)."""
    if str(data_cfg.validation).strip() == "none" or e.interval == 0:
        return None
    source = open_validation(data_cfg, seq_len, data.order.sources[0])
    evaluator = Evaluator(model, source, plan, dp_rank, batches=e.batches, interval=e.interval, total_steps=steps,
                          eos_id=data.dataset.eos_id, device=device, dp_group=dp_group, autocast=autocast,
                          cross_document_loss=data_cfg.cross_document_loss, loss_parallel=loss_parallel)
    log.info("validation: %s, %d of its %d sequences (%d batches of %d) every %d steps, after the last step and "
             "before every save", source.path, evaluator.num_sequences, source.num_sequences, e.batches,
             plan.global_batch_size, e.interval)
    return evaluator
