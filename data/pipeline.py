"""The object train.py holds: per-rank micro-batches of each step, and the data state.

Transport is torchdata's ``StatefulDataLoader`` (``num_workers`` processes, each keeping
``prefetch_factor`` micro-batches in flight). Its own per-worker state is deliberately not
used: the position is ours (``samples_consumed``), so on resume the loader is rebuilt to
start exactly there, whatever ``num_workers`` or dp size the resumed run has. Prefetched
but unconsumed micro-batches are simply dropped; nothing is replayed.

Checkpoint contract (torch.distributed.checkpoint ``Stateful``):
  * ``state_dict()`` -> a small dict of ints and strings, identical on every rank; save it
    as the data state after a step completes.
  * ``load_state_dict(state)`` on every rank, on resume, BEFORE the first
    ``next_micro_batches`` call. The next step then reads global samples
    ``[samples_consumed, samples_consumed + global_batch_size)``, and ``next_micro_batches``
    insists on being called with ``step == state["step"]``, so a resume that restores the
    model but forgets the data fails loudly instead of replaying data.
"""

from __future__ import annotations

import logging
import multiprocessing
import warnings
from typing import Collection, Dict, Iterator, List, Tuple

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from data.batching import BatchPlan, SampleRange, rank_micro_batches
from data.dataset import MicroBatchDataset
from data.order import SampleOrder
from data.state import MEANING_FIELDS, DataState, check_resume

log = logging.getLogger("trainer")

MicroBatch = Tuple[torch.Tensor, torch.Tensor]


class RankSampler:
    """This rank's micro-batch sample ranges, step after step, from global sample ``start``."""

    def __init__(self, plan: BatchPlan, dp_rank: int, start: int):
        self.plan, self.dp_rank, self.start = plan, dp_rank, start

    def __iter__(self) -> Iterator[SampleRange]:
        batch_start = self.start
        while True:
            yield from rank_micro_batches(self.plan, batch_start, self.dp_rank)
            batch_start += self.plan.global_batch_size


def _as_is(item):
    return item


def _workers_context():
    """Loader workers are forked from a server process started once (torch and this module imported there
    already), not from the training process: they start at the first step and again after a rollback or a
    resume, while its threads (the watchdog, the lease's heartbeat, an async save's writer) may hold a lock
    that a fork would copy, held, into the worker."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", __name__])
    return context


class DataPipeline:
    def __init__(self, order: SampleOrder, plan: BatchPlan, dp_rank: int, *, seq_len: int, eos_id: int,
                 cross_document_loss: bool = True, num_workers: int = 0, prefetch_factor: int = 2,
                 pin_memory: bool = False, allowed_resume_changes: Collection[str] = ()):
        if num_workers < 0:
            raise ValueError(f"data.num_workers={num_workers} must be >= 0 (0 loads in the training process)")
        if num_workers > 0 and prefetch_factor < 1:
            raise ValueError(f"data.prefetch_factor={prefetch_factor} must be >= 1 when data.num_workers > 0")
        self.order = order
        self.plan = plan
        self.dp_rank = dp_rank
        self.seq_len = seq_len
        self.dataset = MicroBatchDataset(order, eos_id, cross_document_loss)
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        unknown = set(allowed_resume_changes) - set(MEANING_FIELDS)
        if unknown:
            raise ValueError(f"allowed_resume_changes {sorted(unknown)}: choose among {list(MEANING_FIELDS)}")
        self.allowed_resume_changes = tuple(allowed_resume_changes)
        self.step = 0
        self.samples_consumed = 0
        self.global_target_tokens = 0  # of the last step's global batch (next_micro_batches)
        self._batches: Iterator[MicroBatch] | None = None

    # -- the training loop's side -------------------------------------------------------
    def next_micro_batches(self, step: int) -> List[MicroBatch]:
        """This rank's ``grad_accum_steps`` (inputs, targets) int64 micro-batches of ``step``."""
        if step != self.step:
            raise RuntimeError(
                f"the trainer asks for step {step}, but the data pipeline is at step {self.step} "
                f"(samples_consumed={self.samples_consumed}). On resume, call load_state_dict() with the "
                "checkpoint's data state before the first step; never skip or repeat steps."
            )
        if self._batches is None:
            self._batches = iter(self._loader(self.samples_consumed))
        micro_batches = [next(self._batches) for _ in range(self.plan.grad_accum_steps)]
        # the whole global batch's target count, the same on every rank: the loss's denominator
        # without a collective (training/step.py)
        self.global_target_tokens = self.dataset.target_count(
            SampleRange(self.samples_consumed, self.plan.global_batch_size))
        self.step += 1
        self.samples_consumed += self.plan.global_batch_size
        return micro_batches

    def skip_samples(self, count: int) -> None:
        """Jump ``count`` global samples ahead without a step (the guards' rollback skips the
        data window that preceded an alarm); the next step reads from the new position."""
        if count < 0 or count % self.plan.global_batch_size:
            raise ValueError(f"skip_samples({count}): must be a non-negative multiple of the global batch "
                             f"({self.plan.global_batch_size})")
        self.close()
        self.samples_consumed += count

    def set_split(self, plan: BatchPlan, dp_rank: int) -> None:
        """Read the next steps as data-parallel rank ``dp_rank`` of ``plan`` (same global batch, another number
        of ranks): the replica groups of a step's quorum share the global batch (recovery/fault_tolerance.py).
        The loader restarts at the current position when the split changes; the global order is the same."""
        if plan.global_batch_size != self.plan.global_batch_size:
            raise ValueError(f"set_split: the global batch is {self.plan.global_batch_size} sequences, not "
                             f"{plan.global_batch_size}")
        if (plan, dp_rank) != (self.plan, self.dp_rank):
            self.close()
            self.plan, self.dp_rank = plan, dp_rank

    def upcoming_sample_ids(self) -> List[np.ndarray]:
        """Sequence ids of this rank's micro-batches in the next step (what it will load)."""
        return [self.order.sequence_ids(np.arange(r.start, r.start + r.count))
                for r in rank_micro_batches(self.plan, self.samples_consumed, self.dp_rank)]

    def close(self) -> None:
        """Stop the loader's worker processes now (they are rebuilt on the next step); dropping
        the iterator alone would leave them to the garbage collector."""
        batches, self._batches = self._batches, None
        stop = getattr(batches, "_shutdown_workers", None)  # the multi-process iterator's own shutdown
        if stop is not None:
            stop()

    def _loader(self, start: int) -> StatefulDataLoader:
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 noise
        # A generator of its own: without one, starting an iterator draws the workers' base
        # seed from the global torch RNG, which would shift dropout masks after a resume.
        generator = torch.Generator().manual_seed(self.order.seed)
        return StatefulDataLoader(
            self.dataset, batch_size=None, sampler=RankSampler(self.plan, self.dp_rank, start),
            collate_fn=_as_is, num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None, generator=generator,
            multiprocessing_context=_workers_context() if self.num_workers > 0 else None,
        )

    # -- the checkpoint's side (Stateful) -----------------------------------------------
    def _state(self) -> DataState:
        return DataState(
            step=self.step, samples_consumed=self.samples_consumed,
            epoch=min(self.order.epochs(self.samples_consumed)), seed=self.order.seed,
            global_batch_size=self.plan.global_batch_size, seq_len=self.seq_len,
            fingerprint=self.order.fingerprint,
        )

    def state_dict(self) -> Dict[str, object]:
        """The data position: a few ints and strings, identical on every rank."""
        return self._state().to_dict()

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Continue from a saved position in O(1): checks what the samples mean, then jumps."""
        saved = DataState.from_dict(state)
        changes = check_resume(saved, self._state(), self.allowed_resume_changes)
        if changes:
            log.warning("resuming at global sample %d of a different sample order (allowed: %s); changed: %s",
                        saved.samples_consumed, ", ".join(self.allowed_resume_changes), "; ".join(changes))
        self.close()
        self.step = saved.step
        self.samples_consumed = saved.samples_consumed
        log.info("data resumes at step %d, global sample %d (epoch %s)", self.step, self.samples_consumed,
                 self.order.epochs(self.samples_consumed))
