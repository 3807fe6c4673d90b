"""Per-block activation checkpointing (full or selective) and per-block torch.compile.

Both replace a block's ``forward`` in place instead of wrapping the module, so parameter
names (and therefore checkpoints and the tensor-parallel plan) stay those of the model. Which
modules are the blocks is the model's to say (model/parallelize.py).
"""

from __future__ import annotations

import functools
from typing import List

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallel.config import ACTIVATION_CHECKPOINTING

AC_MODES = ACTIVATION_CHECKPOINTING

# Selective: keep what is expensive to recompute (matmuls, attention, the TP reduce-scatter after
# the row-parallel matmuls, which would otherwise run again in backward), recompute the cheap,
# memory-heavy elementwise work (norms, rotary, the FFN's activation, residual adds). The all-gathers
# before the column-parallel matmuls are recomputed: keeping their full-sequence outputs would
# cost two activations of the whole sequence per block (tests/integration/test_parallel.py counts both).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(blocks: List[nn.Module], mode: str) -> None:
    """Recompute each block's activations in backward: all of them (full) or the cheap ones."""
    if mode not in AC_MODES:
        raise ValueError(f"parallel.activation_checkpoint={mode!r}: choose one of {list(AC_MODES)}")
    if mode == "none":
        return
    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **extra)


def apply_compile(blocks: List[nn.Module]) -> None:
    """Compile each block's forward separately: blocks are identical, so one graph is compiled
    and reused, and FSDP2's per-block hooks (which run around ``forward``) stay outside it."""
    for block in blocks:
        block.forward = torch.compile(block.forward)
