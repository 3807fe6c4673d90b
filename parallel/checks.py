"""The parallel section checked at start-up (torch-free; trainer/checks.py gathers it): device, dtypes,
timeouts, and, once the world size is known, the layout, the batch split and tensor-parallel fit."""

from __future__ import annotations

from typing import Tuple

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
    sizes = world if isinstance(world, tuple) else (world,)
    failing = [(size, found) for size in sizes for found in [layout_problems(cfg, size)] if found]
    if not failing:
        return
    if len(sizes) == 1:
        problems += failing[0][1]
        return
    size, found = failing[0]  # an elastic range: the first world size that fails, and which others do
    others = [n for n, _ in failing[1:]]
    where = (f"at world size {size} (the elastic range forms world sizes {sizes[0]} to {sizes[-1]}; "
             + (f"{others} fail too" if others else "the others work") + "): ")
    problems += [where + message for message in found]


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
