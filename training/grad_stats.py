"""The step's numbers from one all-reduce: the loss and every layer's gradient norm.

After backward, each rank holds its share of the gradients (FSDP2 shards, TP shards, replicas)
and of the loss (its data-parallel slice). One fused pass (``torch._foreach_norm`` over the
local gradients, in float64) gives each parameter's squared norm; a fixed matrix sums them per
layer, weighted so that the sum over all ranks counts each element once; the loss rides in the
same vector, and so do the flags every rank must act on at one step (preemption, a failed save:
recovery/runtime.py), each rank adding 1 where its flag is set. One all-reduce over every rank, one
copy to the host: the guards, the clipping norm, the logged loss and the flags all come from it, the
same bits on every rank (a verdict that decides which collectives follow must be). The flags ride
the training group's reduction rather than a gloo all-reduce of their own: at 512 ranks that one is
about a thousand sequential hops on the host, every step. No arithmetic per parameter in Python, and no other collective
but one: under TP without FSDP2, the replicated norm weights' gradients arrive as per-rank partial
sums, which are summed over the tp ranks first (the optimizer would otherwise do it itself).

Squared in float64: one corrupted fp32 element (up to 3.4e38) squares to at most ~1e77, which
float64 holds, so the guards see a huge but finite norm and judge it against the history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from parallel import collectives


def layer_groups(model: nn.Module) -> Dict[str, List[nn.Parameter]]:
    """Parameters grouped the way people read a transformer: embedding, each block, head. A block's
    group is its name up to the layer index, any other's the name of the top-level module."""
    groups: Dict[str, List[nn.Parameter]] = {}
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:  # tied weights count once
            continue
        seen.add(id(param))
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), 0)
        key = ".".join(parts[:index + 1])
        groups.setdefault(key, []).append(param)
    return groups


def _copies(grad: torch.Tensor, world_size: int) -> int:
    """How many ranks hold each element of ``grad``'s local tensor (its placements, pending sums resolved)."""
    if not hasattr(grad, "device_mesh"):
        return world_size
    copies = world_size // grad.device_mesh.size()
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Replicate):
            copies *= grad.device_mesh.size(dim)
    return copies


def _is_pending(grad) -> bool:
    return grad is not None and hasattr(grad, "placements") and any(p.is_partial() for p in grad.placements)


def _pending_batches(params: List[nn.Parameter]) -> List[Tuple[Tuple[int, ...], bool, List[int]]]:
    """(partial dims, reduced by sum, parameter indices) for the gradients that arrive as partial sums,
    one batch per mesh, partial dims and dtype: each batch is summed in one coalesced all-reduce."""
    batches: Dict[tuple, List[int]] = {}
    for i, p in enumerate(params):
        grad = p.grad
        if _is_pending(grad):
            dims = tuple(d for d, pl in enumerate(grad.placements) if pl.is_partial())
            summed = all(getattr(grad.placements[d], "reduce_op", None) == "sum" for d in dims)
            batches.setdefault((id(grad.device_mesh), dims, grad.dtype, summed), []).append(i)
    return [(dims, summed, members) for (_, dims, _, summed), members in batches.items()]


@dataclass
class StepStats:
    loss: float  # mean token loss over the global batch
    layer_norms: Dict[str, float]  # each group's gradient L2 norm over the whole model
    grad_norm: float  # the whole model's gradient L2 norm
    flags: Tuple[bool, ...] = ()  # each of ``reduce``'s flags: true on some rank


class GradStats:
    """Built once per run (the grouping and the weights are fixed); ``reduce`` once per step."""

    def __init__(self, model: Optional[nn.Module], device: torch.device, loss_copies: int = 1,
                 groups: Optional[Dict[str, List[nn.Parameter]]] = None):
        self.model, self.groups, self.device = model, groups, device
        self.world = collectives.world()
        self.loss_copies = loss_copies  # ranks that hold the same loss share (tp): each adds 1/copies
        self.params: List[nn.Parameter] = []
        self.weights: Optional[torch.Tensor] = None  # [groups, params]: 1/copies where a param is in a group
        # params whose gradients arrive as partial sums, batched by (mesh, partial dims, dtype, is a sum)
        self.pending: List[Tuple[Tuple[int, ...], bool, List[int]]] = []

    def _first_gradients(self) -> None:
        """Once, from the first step's gradients (their placements do not change): which arrive as
        partial sums (a replicated weight under TP without FSDP2: sequence parallel leaves each tp
        rank its part of the norm weights' gradients), and the weights of the per-group sums. The
        parameters are read from the model here, after a backward: FSDP2's root module keeps its
        parameters gathered after a forward without backward (the probe's, at a resume), and
        those gathered tensors never get gradients."""
        if self.model is not None:
            self.groups = layer_groups(self.model)
        self.params = [p for params in self.groups.values() for p in params]
        self.pending = _pending_batches(self.params)
        self._resolve_pending()
        weights = torch.zeros(len(self.groups), len(self.params), dtype=torch.float64)
        col = 0
        for row, params in enumerate(self.groups.values()):
            for p in params:
                weights[row, col] = 1.0 / _copies(p.grad if p.grad is not None else p, self.world)
                col += 1
        self.weights = weights.to(self.device)

    def _resolve_pending(self) -> None:
        """Sum the partial gradients over their ranks (what the optimizer would do for each of them,
        one DTensor redistribute per tensor): all of them in one all-reduce, per mesh and partial
        dimensions, i.e. one over the tp group (the TP gradient sum, as Megatron's coalesced one of
        the layer norms' gradients under sequence parallel)."""
        for dims, summed, batch in self.pending:
            members = [i for i in batch if _is_pending(self.params[i].grad)]  # not None: used this step
            if not members:
                continue
            grads = [self.params[i].grad for i in members]
            if not summed:  # another reduction: left to DTensor, tensor by tensor
                for i, grad in zip(members, grads):
                    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
                    self.params[i].grad = grad.redistribute(grad.device_mesh, placements)
                continue
            mesh = grads[0].device_mesh
            local = [g.to_local() for g in grads]
            for dim in dims:
                local = collectives.all_reduce_coalesced(local, mesh.get_group(dim))
            for i, grad, summed_local in zip(members, grads, local):
                placements = [Replicate() if p.is_partial() else p for p in grad.placements]
                self.params[i].grad = DTensor.from_local(summed_local, mesh, placements, run_check=False)

    def local_squares(self) -> torch.Tensor:
        """This rank's weighted share of each group's squared gradient norm (float64, on device)."""
        if self.weights is None:
            self._first_gradients()
        else:
            self._resolve_pending()
        present = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not present:
            return torch.zeros(len(self.groups), dtype=torch.float64, device=self.device)
        local = [getattr(self.params[i].grad, "_local_tensor", self.params[i].grad) for i in present]
        # (with parallel.cpu_offload the gradients live in host memory: their norms join the device's vector)
        squares = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float64)).square().to(self.device)
        weights = self.weights if len(present) == len(self.params) else self.weights[:, present]
        return weights @ squares

    def grads(self) -> List[torch.Tensor]:
        """The local gradient tensors (what clipping scales)."""
        return [getattr(p.grad, "_local_tensor", p.grad) for p in self.params if p.grad is not None]

    def reduce(self, loss_sum: torch.Tensor, global_tokens: int, flags: Sequence[bool] = ()) -> StepStats:
        """``loss_sum``: this rank's summed token loss (float64 0-d, on device); ``flags``: this rank's,
        true in the result where any rank's is. The step's one all-reduce and its one host sync."""
        marks = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64, device=self.device)
        vector = torch.cat([self.local_squares(), (loss_sum / self.loss_copies).reshape(1), marks])
        values = collectives.all_reduce(vector).tolist()
        values, marks = values[:len(values) - len(flags)], values[len(values) - len(flags):]
        norms = {name: math.sqrt(max(v, 0.0)) if math.isfinite(v) else v for name, v in zip(self.groups, values)}
        total = sum(values[:-1])
        grad_norm = math.sqrt(max(total, 0.0)) if math.isfinite(total) else total
        return StepStats(loss=values[-1] / global_tokens, layer_norms=norms, grad_norm=grad_norm,
                         flags=tuple(m > 0 for m in marks))

    def clip(self, grad_norm: float, max_norm: float) -> None:
        """Scale the gradients so their norm is at most ``max_norm`` (as clip_grad_norm_ does, with
        the norm already reduced: no collective, no sync)."""
        coef = max_norm / (grad_norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(self.grads(), coef)


def layer_grad_norms(groups: Dict[str, List[nn.Parameter]], device: torch.device) -> Dict[str, float]:
    """L2 norm of each group's gradient over the whole model (all ranks agree on the result)."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return GradStats(None, device, groups=groups).reduce(zero, 1).layer_norms
