"""The planner's activation term (model/activation_memory.py) against what autograd keeps, on CPU.

Two measurements of one forward pass + the training step's loss (training/step.py's
token_loss_sum), both excluding parameters and buffers:
  saved   bytes of the distinct storages packed by torch.autograd.graph.saved_tensors_hooks,
          plus the logits (the training step holds them until backward)
  alive   bytes of every storage created during the forward (a dispatch mode keeps a weak
          reference to each op's outputs) that is still alive after it; this one also sees
          what activation checkpointing keeps (block inputs, selective checkpointing's cache)
The debug and 125m shapes (125m with 2 of its layers), in fp32, with bf16 parameters under autocast (FSDP2's
param_dtype=bf16) and with fp32 parameters under autocast (bf16 weight copies saved), with
selective and full checkpointing, and under tp=2 with sequence parallel and loss parallel
(rank 0 of a fake process group); the formula must agree within 20% (it agrees within 1.3%).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context
from torch.multiprocessing.reductions import StorageWeakRef
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from model.activation_memory import activation_memory
from model.config import ModelConfig
from model.llama import build_model
from model.parallelize import parallel_plan
from parallel.activations import apply_activation_checkpointing
from support.launch import ROOT
from training.step import token_loss_sum

TOLERANCE = 0.20
PRECISIONS = {  # name: (parameters dtype, autocast, compute bytes, fp32 weights under autocast)
    "fp32": (torch.float32, False, 4, False),
    "bf16_params": (torch.bfloat16, True, 2, False),
    "fp32_params_autocast": (torch.float32, True, 2, True),
}


def preset(name: str) -> ModelConfig:
    """A preset of configs/model/; ``125m`` keeps its width and vocabulary with 2 of its 12 layers (the
    formula is per layer plus the logits, and every layer is the same: 2 layers check the sum)."""
    cfg = OmegaConf.load(ROOT / "configs" / "model" / f"{name}.yaml")
    if name == "125m":
        cfg.n_layers = 2
    return ModelConfig(**OmegaConf.to_container(cfg))


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def plain_tensors(t: torch.Tensor):
    """The tensors with storage inside ``t`` (a wrapper subclass such as DTensor or a
    collective's result holds its data in inner tensors)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [getattr(t, a) for a in attrs]
        return [x for i in inner if isinstance(i, torch.Tensor) for x in plain_tensors(i)]
    return [t]


class OutputStorages(TorchDispatchMode):
    """Weak references to the storage of every op's outputs."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            for inner in plain_tensors(t) if isinstance(t, torch.Tensor) else ():
                storage = inner.untyped_storage()
                self.refs.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        return out


def measure(cfg: ModelConfig, batch: int, seq: int, precision: str, mode: str):
    dtype, autocast, _, _ = PRECISIONS[precision]
    model = build_model(cfg, seed=0).to(dtype)
    apply_activation_checkpointing(parallel_plan(model, loss_parallel=False).blocks, mode)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    static = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), inputs, targets]}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in static:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    outputs = OutputStorages()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), outputs:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(inputs)
        loss = token_loss_sum(logits, targets)
    saved.setdefault(logits.untyped_storage().data_ptr(), logits.untyped_storage().nbytes())
    alive = {ptr: n for ref, ptr, n in outputs.refs if not ref.expired() and ptr not in static}
    assert loss.requires_grad  # the graph (and what it saved) is still there
    return sum(saved.values()), sum(alive.values())


NONE_CASES = [("debug", 4, 128, p) for p in PRECISIONS] + [("125m", 1, 64, "bf16_params")]


@pytest.mark.parametrize("shape, batch, seq, precision", NONE_CASES)
def test_saved_tensor_bytes_match_the_formula(shape, batch, seq, precision):
    cfg = preset(shape)
    _, _, compute_bytes, copies = PRECISIONS[precision]
    predicted = activation_memory(cfg, batch, seq, mode="none", compute_bytes=compute_bytes,
                                  fp32_params_under_autocast=copies).saved
    saved, alive = measure(cfg, batch, seq, precision, "none")
    assert abs(predicted - saved) <= TOLERANCE * saved, (predicted, saved)
    assert abs(predicted - alive) <= TOLERANCE * alive, (predicted, alive)


@pytest.mark.parametrize("shape, batch, seq, mode", [("debug", 4, 128, "selective"), ("debug", 4, 128, "full"),
                                                     ("125m", 1, 64, "full")])
def test_checkpointed_activation_bytes_match_the_formula(shape, batch, seq, mode):
    cfg = preset(shape)
    predicted = activation_memory(cfg, batch, seq, mode=mode, compute_bytes=2)
    _, alive = measure(cfg, batch, seq, "bf16_params", mode)
    assert abs(predicted.saved - alive) <= TOLERANCE * alive, (predicted.saved, alive)
    assert predicted.saved < activation_memory(cfg, batch, seq, mode="none", compute_bytes=2).saved


def test_tensor_parallel_terms_split_what_tp_splits():
    """tp=8, sequence parallel: the norms' tensors shrink 8x, the gathered matmul inputs do not."""
    cfg = preset("70b")
    one = activation_memory(cfg, 1, 8192, tp=1, mode="none")
    eight = activation_memory(cfg, 1, 8192, tp=8, mode="none")
    b, s, d = 1, 8192, cfg.dim
    gathered = 2 * 2 * b * s * d  # the inputs of wq/wk/wv and of w1/w3, bf16, full sequence
    assert eight.per_block - gathered == (one.per_block - gathered) // 8
    assert activation_memory(cfg, 1, 8192, tp=8, mode="full").per_block == 2 * b * s * d // 8


@pytest.mark.parametrize("mode, loss_parallel", [("none", False), ("selective", False), ("full", False),
                                                 ("none", True)])
def test_tensor_parallel_bytes_match_on_a_fake_process_group(mode, loss_parallel):
    """tp=2 with sequence parallel, the real plan (parallelize_model) on rank 0 of a fake process
    group (collectives return at once; shapes are exact), bf16 parameters under autocast."""
    from parallel.config import ParallelConfig
    from parallel.dims import resolve_parallel_dims
    from parallel.parallelize import materialize_parallel_model, parallelize_model

    cfg, batch, seq, tp = preset("debug"), 4, 128, 2
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        model = build_model(cfg, materialize=False)
        pcfg = ParallelConfig(device="cpu", tp=tp, dp_shard=1, activation_checkpoint=mode, loss_parallel=loss_parallel)
        parallel = parallelize_model(model, resolve_parallel_dims(1, 1, tp, tp), pcfg, torch.device("cpu"), seq)
        materialize_parallel_model(model, parallel, torch.device("cpu"), seed=0)
        model.to(torch.bfloat16)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        static = {local(t).untyped_storage().data_ptr()
                  for t in [*model.parameters(), *model.buffers(), inputs, targets]}
        outputs = OutputStorages()
        with outputs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(inputs)
            with loss_parallel_context() if loss_parallel else contextlib.nullcontext():
                loss = token_loss_sum(logits, targets)
        alive = sum({ptr: n for ref, ptr, n in outputs.refs if not ref.expired() and ptr not in static}.values())
        assert loss.requires_grad
    finally:
        dist.destroy_process_group()
    predicted = activation_memory(cfg, batch, seq, tp=tp, mode=mode, compute_bytes=2, loss_parallel=loss_parallel)
    assert abs(predicted.saved - alive) <= TOLERANCE * alive, (predicted.saved, alive)
