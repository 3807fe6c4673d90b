"""The parallel section checked at start-up (torch-free; trainer/checks.py gathers it): device, dtypes,
timeouts, and, once the world size is known, the layout, the batch split and tensor-parallel fit."""

from __future__ import annotations

from typing import List, Tuple

from configs.checks import Problems
from configs.constants import ACTIVATION_CHECKPOINTING, DEVICES, PARAM_DTYPES
from data.batching import make_batch_plan
from model.config import model_config
from parallel.dims import check_tensor_parallel_fits, resolve_parallel_dims


def config_problems(cfg, problems: Problems, world: int | Tuple[int, ...] | None) -> None:
    """The section's values; with ``world`` (a world size, or each one an elastic range may form) the layout."""
    p = cfg.parallel
    problems.choice("parallel.device", p.device, DEVICES)
    problems.choice("parallel.param_dtype", p.param_dtype, PARAM_DTYPES)
    problems.choice("parallel.reduce_dtype", p.reduce_dtype, PARAM_DTYPES)
    problems.choice("parallel.activation_checkpoint", p.activation_checkpoint, ACTIVATION_CHECKPOINTING)
    problems.positive("parallel.collective_timeout_s", p.collective_timeout_s)
    problems.positive("parallel.collective_timeout_after_first_step_s", p.collective_timeout_after_first_step_s)
    if world is None:  # the layout is checked once the world size is known
        return
    if not isinstance(world, tuple):
        problems += layout_problems(cfg, world)
        return
    largest = world[-1]  # an elastic range: torchrun forms the group at its largest once every node joined
    found = layout_problems(cfg, largest)
    if found:
        works = [n for n in world[:-1] if not layout_problems(cfg, n)]
        which = f"world sizes {works} of the range work" if works else "no world size of the range works"
        where = (f"at world size {largest}, the largest of the elastic range {world[0]} to {largest} (the group "
                 f"torchrun forms once every node joined; {which}): ")
        problems += [where + message for message in found]


def elastic_warnings(cfg, world: int | Tuple[int, ...] | None) -> List[str]:
    """An elastic range whose largest world size works but some smaller ones do not: a group re-formed at one of
    them (after a node was lost) would stop with exit 2."""
    if not isinstance(world, tuple) or layout_problems(cfg, world[-1]):
        return []
    failing = [(n, found) for n in world[:-1] for found in [layout_problems(cfg, n)] if found]
    if not failing:
        return []
    return [f"world sizes {[n for n, _ in failing]} of the elastic range {world[0]} to {world[-1]} cannot run this "
            f"layout, so a group re-formed at one of them (after a node is lost) stops with exit 2 (at "
            f"{failing[0][0]}: {failing[0][1][0]}); narrow --nnodes, or choose training.global_batch_size and "
            "training.micro_batch_size that every data-parallel size of the range divides"]


def layout_problems(cfg, world: int) -> Problems:
    """The layout at ``world`` ranks: the mesh, the batch split and the tensor-parallel fit."""
    p, problems = cfg.parallel, Problems()
    dims = problems.check(lambda: resolve_parallel_dims(p.dp_replicate, p.dp_shard, p.tp, world))
    if dims is None:
        return problems
    if not cfg.dry_run:  # a plan is about memory: the micro batch is the user's to adjust after it
        problems.check(lambda: make_batch_plan(cfg.training.global_batch_size, cfg.training.micro_batch_size, dims.dp))
    problems.check(lambda: check_tensor_parallel_fits(model_config(cfg), dims.tp, cfg.training.seq_len))
    return problems
