"""The probe (recovery/probe.py): bounded memory at 70B, computed once per set of weights.

The largest tensor is measured on the meta device at the 70b shapes under TP 8 with loss
parallel (a fake process group, as planner/plan.py uses; 2 of the 80 blocks: the largest tensor
does not depend on the depth). F.scaled_dot_product_attention stands in as a fused kernel (its
output shaped as q), as flash attention is on a GPU: on the meta device it would run the math
path, whose score matrix no GPU kernel materialises.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from checkpoint.state.training_state import TrainingState
from model.config import ModelConfig
from model.llama import build_model
from parallel.config import ParallelConfig
from parallel.dims import resolve_parallel_dims
from parallel.parallelize import parallelize_model
from recovery.probe import PROBE_SEQUENCES, Probe, probe_token_loss_sum
from support.launch import ROOT

S, V, TP = 8192, 128256, 8


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op creates (a rank's local shard of a DTensor; views excluded)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.where = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                local = t._local_tensor if hasattr(t, "_local_tensor") else t
                if not local._is_view() and local.nbytes > self.bytes:
                    self.bytes, self.where = local.nbytes, (str(func), tuple(local.shape), local.dtype)
        return out


@pytest.fixture
def tp8_70b(monkeypatch):
    raw = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / "70b.yaml"))
    mcfg = ModelConfig(**{**raw, "n_layers": 2})
    dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
    try:
        model = build_model(mcfg, materialize=False)
        cfg = ParallelConfig(dp_shard=1, tp=TP, device="cpu", loss_parallel=True)
        parallelize_model(model, resolve_parallel_dims(1, 1, TP, TP), cfg, torch.device("cpu"), seq_len=S)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda q, k, v, **kw: torch.empty_like(q))
        yield model
    finally:
        dist.destroy_process_group()


def test_the_probes_largest_tensor_at_70b_is_one_sequences_logits_shard(tp8_70b):
    batch = (torch.zeros(PROBE_SEQUENCES, S, dtype=torch.long), torch.zeros(PROBE_SEQUENCES, S, dtype=torch.long))
    with LargestTensor() as seen:
        probe_token_loss_sum(tp8_70b, batch, torch.device("meta"),
                             lambda: torch.autocast("cpu", dtype=torch.bfloat16), loss_parallel=True)
    # one sequence's logits for this rank's 16032 vocabulary rows, in fp32 (the cross entropy's upcast)
    shard = 1 * S * (V // TP) * 4
    assert seen.bytes == shard == 525_336_576, seen.where  # 0.5 GB
    # what the probe used to hold: the four sequences' full logits in fp32 (full_tensor, then .float())
    assert PROBE_SEQUENCES * S * V * 4 == 32 * shard  # 16.8 GB


def test_the_probe_runs_once_per_set_of_weights():
    model = build_model(ModelConfig(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    rows = torch.randint(0, 256, (PROBE_SEQUENCES, 17), generator=torch.Generator().manual_seed(1))
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    probe = Probe(model, (rows[:, :-1], rows[:, 1:]), torch.device("cpu"),
                  weights_version=lambda: state.weights_version)
    first = probe()
    assert len(forwards) == PROBE_SEQUENCES  # one sequence at a time
    assert probe() == first and len(forwards) == PROBE_SEQUENCES and probe.last_seconds == 0.0  # cached
    model(rows[:, :-1]).sum().backward()
    optimizer.step()
    state.record_step(16 * PROBE_SEQUENCES, PROBE_SEQUENCES)  # new weights: computed again
    second = probe()
    assert len(forwards) == 2 * PROBE_SEQUENCES + 1 and second != first
    sd = state.state_dict()
    state.load_state_dict(sd)  # a load: computed again
    assert probe() == second and len(forwards) == 3 * PROBE_SEQUENCES + 1
