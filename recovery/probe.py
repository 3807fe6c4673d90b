"""The probe loss: the loss of a known batch with the saved weights, stored in the manifest.

After a resume, recomputing it on the loaded weights proves the weights are the saved ones (bitwise
at the same layout). Two batches, named by the manifest's ``probe_method``:

- NEXT_MICRO_BATCH, an async save the loop follows with a step: the loss of that step's first
  micro-batch on rank 0 (global samples ``probe_samples``), which the step computes anyway with the
  saved weights (the update comes after its forward). The save runs no forward; its commit waits for
  that loss (checkpoint/manager.py ``took_step``). A resume recomputes it as one batch, as the step did.
- PROBE_METHOD, every other save (sync, the last, a model with dropout, ``best_metric=probe_loss``,
  which compares checkpoints on one batch) and the shadow guard: global samples [0, PROBE_SEQUENCES)
  of the sample order, one sequence at a time: the same at every layout and micro-batch size.

The fixed batch must stay cheap at 70B: it runs at the saves above, for the shadow guard and at their
resumes (a memory snapshot runs none: checkpoint/memory/snapshot.py compares its bytes). So one sequence
at a time, and with ``loss_parallel`` on the vocabulary-sharded logits: its largest tensor is one
sequence's logits of this rank's vocabulary shard, in fp32, never the full logits (4 x 8192 x 128256 at
70B: 16.8 GB in fp32; tests/unit/test_probe.py). The value is cached per ``weights_version`` (the
training state's counter, advanced by every optimizer step and load: tensors' own version counters do
not see FSDP2's updates of its shards), so a step with a durable save and a shadow check computes it once.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional

import torch

from checkpoint.durable.manifest import NEXT_MICRO_BATCH
from data.batching import SampleRange, rank_micro_batches
from data.dataset import IGNORE_INDEX
from training.evaluate import loss_sum

PROBE_SEQUENCES = 4
# Stored in each manifest: the probe is compared bitwise only with a value computed the same way
# (before this method, the four sequences ran as one batch of full logits: manifests without it).
PROBE_METHOD = "per-sequence-float64-sum"


def kernel_identity(device: torch.device) -> Dict[str, object]:
    """What decides which kernels compute the probe here, stored beside the probe loss in every manifest:
    the device (its name on CUDA, the CPU's vector capability otherwise), torch and its CUDA, cuDNN and
    NCCL builds (NCCL's reductions inside TP and loss_parallel order the sums), and the
    deterministic-algorithms flag. Every rank compares its own probe with the stored one (rank 0's):
    bitwise only where its own identity is the stored one (and the layout is the same), elsewhere within
    recovery.probe_rtol_reshard, so one node with another stack does not condemn good checkpoints."""
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu {torch.backends.cpu.get_cpu_capability()}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


class Probe:
    """Call it for the probe loss of the current weights (every rank calls it: collectives inside)."""

    method = PROBE_METHOD
    methods = (PROBE_METHOD, NEXT_MICRO_BATCH)  # what value_for computes, each as its manifests' probe was

    def __init__(self, model: torch.nn.Module, batch, device: torch.device, autocast=None,
                 loss_parallel: bool = False, weights_version: Optional[Callable[[], int]] = None, data=None):
        """``data``: the training DataPipeline, whose batches NEXT_MICRO_BATCH names (None: PROBE_METHOD only)."""
        self.kernels = kernel_identity(device)  # rank 0's goes into the manifest
        self.model, self.batch, self.device, self.data = model, batch, device, data
        self.autocast, self.loss_parallel = autocast, loss_parallel
        self.weights_version = weights_version  # None: never cached
        self.tokens = int((batch[1] != IGNORE_INDEX).sum())  # fixed: counted once, not at every call
        self._key: Optional[int] = None
        self._value = float("nan")
        self.last_seconds = 0.0  # the time of the last computation (0 when the cached value served)

    def __call__(self) -> float:
        key = self.weights_version() if self.weights_version is not None else None
        if key is not None and key == self._key:
            self.last_seconds = 0.0
            return self._value
        start = time.perf_counter()
        self._value = probe_loss(self.model, self.batch, self.device, self.autocast, self.loss_parallel, self.tokens)
        self._key = key
        self.last_seconds = time.perf_counter() - start
        return self._value

    @property
    def deferrable(self) -> bool:
        """Can a save take the next step's loss as its probe? Not with dropout: the step's forward draws
        masks that a recomputation would not."""
        return self.data is not None and not any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())

    def next_micro_batch(self) -> SampleRange:
        """Rank 0's first micro-batch of the next step (rank 0 is data-parallel rank 0)."""
        return rank_micro_batches(self.data.plan, self.data.samples_consumed, 0)[0]

    def of_samples(self, samples: SampleRange) -> float:
        """NEXT_MICRO_BATCH: the mean token loss of ``samples`` as one batch, computed as the training step
        computes a micro-batch's loss (every rank calls it: collectives inside)."""
        start = time.perf_counter()
        batch = self.data.dataset[samples]
        tokens = int((batch[1] != IGNORE_INDEX).sum())
        total = loss_sum(self.model, [batch], self.device, self.autocast, self.loss_parallel)[0]
        self.last_seconds = time.perf_counter() - start
        return float(total) / tokens

    def value_for(self, method: Optional[str], samples) -> float:
        """The probe loss of these weights computed as a manifest's ``probe_method`` says."""
        return self.of_samples(SampleRange(*samples)) if method == NEXT_MICRO_BATCH else self()


def make_probe(model: torch.nn.Module, data, device: torch.device, autocast=None,
               loss_parallel: bool = False) -> Probe:
    """The run's probe; its fixed batch is global samples [0, PROBE_SEQUENCES)."""
    return Probe(model, data.dataset[SampleRange(0, PROBE_SEQUENCES)], device, autocast, loss_parallel, data=data)


def probe_loss(model: torch.nn.Module, batch, device: torch.device, autocast, loss_parallel: bool,
               tokens: int) -> float:
    """Mean token loss of ``batch`` (``tokens`` targets); every rank calls it. Its one host sync reads the sum."""
    return float(probe_token_loss_sum(model, batch, device, autocast, loss_parallel)) / tokens


def probe_token_loss_sum(model: torch.nn.Module, batch, device: torch.device, autocast=None,
                         loss_parallel: bool = False) -> torch.Tensor:
    """The summed token loss of ``batch``, one sequence at a time (float64, on ``device``): no host sync."""
    inputs, targets = batch
    sequences = ((inputs[i:i + 1], targets[i:i + 1]) for i in range(inputs.shape[0]))
    return loss_sum(model, sequences, device, autocast, loss_parallel)[0]
