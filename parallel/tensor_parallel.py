"""Tensor-parallel plan for model.llama.Transformer (Megatron-style, with sequence parallel).

Inside a block, wq/wk/wv and w1/w3 are split by output columns (each rank holds whole heads
and a slice of the FFN width) and wo/w2 by input rows, so each sub-layer needs one
collective in the forward pass. Between sub-layers the activations are sharded along the
sequence (sequence parallel): the norms run on 1/tp of the positions, and the collectives
become reduce-scatter + all-gather instead of all-reduce. The embedding is split by
vocabulary rows, the output layer by vocabulary columns, which are the rows of its weight
too: a tied embedding is one Shard(0) tensor serving both. With loss parallel the logits stay
sharded by vocabulary and the cross entropy runs on the shards (never materialising the
full (batch, seq, vocab) tensor on one rank).

The model's attention uses -1 for the head count in its views, so the same code runs on the
local heads. check_tensor_parallel_fits (parallel/dims.py) runs before this.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def block_plan() -> dict:
    """Plan for one TransformerBlock; the residual stream enters and leaves sharded on seq."""
    return {
        "attention_norm": SequenceParallel(),
        # attention(x, cos, sin): gather x over the sequence; the rope tables are plain tensors.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard every block, the embedding, the final norm and the output layer over ``tp_mesh``."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Loss parallel keeps the logits as a vocabulary-sharded DTensor for the loss.
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    })
    # Tied embeddings: both plans shard the (vocab, dim) weight by vocabulary rows (Shard(0)),
    # but each replaced its module's parameter with its own DTensor: point the output back at
    # the embedding's, so one tensor (and one gradient) serves both ends.
    model.tie_weights()
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())
