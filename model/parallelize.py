"""How model/llama.py is distributed, in its module names: the tensor-parallel plan, the FSDP2 units and
the blocks that activation checkpointing and compile wrap. parallel/parallelize.py applies the plan with
the layout's mesh and the config's options and names no module, so a change of the model changes this.

Tensor parallel (Megatron-style, with sequence parallel): inside a block, wq/wk/wv and w1/w3 are split
by output columns (each rank holds whole heads and a slice of the FFN width) and wo/w2 by input rows, so
each sub-layer needs one collective in the forward pass. Between sub-layers the activations are sharded
along the sequence (sequence parallel): the norms run on 1/tp of the positions, and the collectives
become reduce-scatter + all-gather instead of all-reduce. The embedding is split by vocabulary rows, the
output layer by vocabulary columns, which are the rows of its weight too: a tied embedding is one
Shard(0) tensor serving both. With loss parallel the logits stay sharded by vocabulary and the cross
entropy runs on the shards (never materialising the full (batch, seq, vocab) tensor on one rank). The
attention uses -1 for the head count in its views, so the same code runs on the local heads;
check_tensor_parallel_fits (parallel/dims.py) runs before this; model/counting.py counts the collectives.

FSDP2: one unit per block, the embedding, and the final norm with the output layer (one all-gather
for both: the output layer runs right after the norm); tied, the embedding joins that last unit (FSDP2
refuses a parameter shared between units).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple, Union

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from model.llama import Transformer


@dataclass(frozen=True)
class ParallelPlan:
    """What parallel/parallelize.py applies to one model."""

    blocks: List[nn.Module]  # the repeated blocks: checkpointing and compile wrap each one's forward
    tensor_parallel: Dict[str, ParallelStyle]  # module path (* for any layer) -> style, for parallelize_module
    # FSDP2 units in the order they are wrapped (the root last, by parallel/), and whether each may free its
    # gathered parameters after forward (parallel.reshard_after_forward): not a unit whose backward comes next
    fsdp_units: List[Tuple[Union[nn.Module, List[nn.Module]], bool]]
    after_tensor_parallel: Callable[[], None]  # tensor parallel replaces parameters per module: tie them again


def parallel_plan(model: Transformer, loss_parallel: bool) -> ParallelPlan:
    """The plan for ``model`` (its modules, so build it first, on the meta device)."""
    blocks = list(model.layers.values())
    per_block = {  # the residual stream enters and leaves a block sharded on the sequence
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
    tensor_parallel = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Loss parallel keeps the logits as a vocabulary-sharded DTensor for the loss.
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        **{f"layers.*.{path}": style for path, style in per_block.items()},
    }
    # The last block's parameters are needed again at once by backward: keep them gathered.
    units = [(block, i < len(blocks) - 1) for i, block in enumerate(blocks)]
    if model.cfg.tie_embeddings:
        # Gathered from the embedding lookup to the end of the output layer's forward, kept for its backward.
        units.append(([model.tok_embeddings, model.norm, model.output], False))
    else:
        units += [(model.tok_embeddings, True), ([model.norm, model.output], False)]
    # Tensor parallel gave the embedding and the output layer a Shard(0) DTensor each: point the output back
    # at the embedding's, so one tensor (and one gradient) serves both ends.
    return ParallelPlan(blocks, tensor_parallel, units, model.tie_weights)
