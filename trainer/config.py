"""The run's config: every section, composed into one typed tree, and what its values can be together.

Each package declares its own section (``<package>/config.py``: each key once, with its type, default, bound
and meaning). ``register`` puts this tree into Hydra's ConfigStore as ``trainer_schema``, which
configs/config.yaml lists first: every YAML file and override is merged into it, so a misspelled key or a
wrong type fails at compose time. ``typed`` then builds the sections themselves (dataclass instances);
components receive their own section, never the whole tree.

``value_problems`` checks the values alone, the same on every rank and without torch: each key against its
declaration, each section's own ``check``, then what involves several sections (the sequence length against
the model's, the layout at the world size). A check that reads a key out of its bound is left out: the bound
is the message, and a search over an absurd value (the divisors of model.dim=99999999999) must not run. What
the files and the world say is the pre-flight's (trainer/preflight.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
import typing
from dataclasses import dataclass, is_dataclass
from typing import Any, Callable, Dict, List, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from checkpoint.config import CheckpointConfig
from checkpoint.storage import local_path
from configs.keys import Bound, ConfigError, declared, hints, in_bounds, key, problems, section
from data.batching import make_batch_plan
from data.config import DataConfig
from metrics.config import LoggingConfig
from model.config import SHAPE_KEYS, ModelConfig, unset_shape
from parallel.config import ParallelConfig
from recovery.config import RecoveryConfig
from training.config import EvalConfig, OptimConfig, TrainingConfig


@dataclass
class Config:
    run_name: str = key("default", "the run's name: its folder under output_root")
    output_root: str = key("outputs", "where runs keep their folders")
    run_dir: str = key("${output_root}/${run_name}", "stable across restarts (never a timestamp): a restarted job "
                       "finds its checkpoints here")
    seed: int = key(1234, "every random number of the run derives from it",
                    Bound(0, 2**32 - 1, why="the range numpy's and torch's generators both accept"))
    dry_run: bool = key(False, "print the config, the model's size and the per-rank plan; allocate nothing")
    check_only: bool = key(False, "run every check train.py runs before building anything, print the block and "
                           "exit (0: accepted, 2: refused); the launchers in scripts/ run it once before the workers")
    model: ModelConfig = section(unset_shape, "the decoder's shape (presets: configs/model/)")
    parallel: ParallelConfig = section(ParallelConfig, "the device mesh and how the model is spread over it")
    data: DataConfig = section(DataConfig, "what the run trains and validates on")
    training: TrainingConfig = section(TrainingConfig, "the step and the batch")
    eval: EvalConfig = section(EvalConfig, "validation")
    optim: OptimConfig = section(OptimConfig, "the optimizer and its schedule")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "saving, keeping and loading the training state")
    recovery: RecoveryConfig = section(RecoveryConfig, "failure detection, resume, faults and guards")
    logging: LoggingConfig = section(LoggingConfig, "log lines and metrics")


def register() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="trainer_schema", node=Config)


def unknown_keys(cfg: DictConfig) -> List[str]:
    """The composed config is closed: a key the schema does not declare (one added with ``+``, which Hydra
    lets through) is an error naming the closest key it does declare."""
    known = [k for k, _, _ in declared(Config) if not k.endswith("*")]
    out = []
    for name in _undeclared(cfg, Config, ""):
        pattern = re.sub(r"\[\d+\]", "[]", name)
        parent = pattern.rsplit(".", 1)[0] if "." in pattern else ""
        siblings = [k for k in known if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
        near = (difflib.get_close_matches(pattern, siblings, n=1, cutoff=0.6)
                or difflib.get_close_matches(pattern, known, n=1, cutoff=0.6))
        hint = f"; did you mean {near[0]}?" if near else ""
        out.append(f"{name}: the schema has no such key{hint} (each section declares its keys in "
                   "<package>/config.py; a key added with + must be declared there first)")
    return out


def _undeclared(node, tp, prefix: str):
    if is_dataclass(tp) and isinstance(node, DictConfig):
        for name in node.keys():
            if name not in hints(tp):
                yield f"{prefix}{name}"
            else:
                yield from _undeclared(node._get_node(name), _plain(hints(tp)[name]), f"{prefix}{name}.")
    elif typing.get_origin(tp) in (list, List) and isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _undeclared(node._get_node(i), typing.get_args(tp)[0], f"{prefix[:-1]}[{i}].")


def _plain(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union else tp


def typed(cfg: DictConfig) -> Tuple[Config, List[str]]:
    """The composed config as its sections (interpolations resolved), and the keys it holds that no section
    declares (each a problem, left out of the sections). A model shape left unset is a ConfigError."""
    if OmegaConf.get_type(cfg) is not Config:  # composed without the schema (a test's, a worker's)
        cfg = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    unset = [k for k in SHAPE_KEYS if OmegaConf.is_missing(cfg.model, k)]
    if unset:
        raise ConfigError(f"invalid configuration:\n  - model.{', model.'.join(unset)} unset: model=hf takes the "
                          "shape from the weights it starts from; add model.init_from=PATH (a Hugging Face Llama "
                          "folder, a checkpoint or an export), or choose a preset (e.g. model=llama3_1_8b)")
    found = unknown_keys(cfg)
    if found:  # the sections without those keys, so that every other problem is found too
        plain = OmegaConf.to_container(cfg)
        for name in _undeclared(cfg, Config, ""):
            *parents, leaf = re.sub(r"\[(\d+)\]", r".\1", name).split(".")
            node = plain
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            del node[leaf]
        cfg = OmegaConf.merge(OmegaConf.structured(Config), plain)
    return OmegaConf.to_object(cfg), found


def as_dict(config: Config) -> Dict[str, Any]:
    """The resolved config as plain data (what a checkpoint's manifest and config.yaml store)."""
    return dataclasses.asdict(config)


World = int | Tuple[int, ...] | None  # a world size, each one an elastic range may form, or not known yet


def value_problems(config: Config, world: World) -> List[str]:
    """Every problem of the values alone (no file is read): each section's (configs/keys.py ``problems``), then
    what several sections cannot be together."""
    found = problems(config)
    p, t = config.parallel, config.training
    checks: List[Callable[[], List[str]]] = [
        lambda: config.optim.check(t.steps),
        lambda: config.recovery.check((p.collective_timeout_s, p.collective_timeout_after_first_step_s)),
        lambda: _seq_len_problems(config),
        lambda: _best_metric_problems(config),
    ]
    ft, rc, ckpt_dir = p.fault_tolerance, config.recovery, local_path(config.checkpoint.dir)  # unit: fault_tolerance
    checks.append(lambda: ft.problems_with(p.dp_replicate, rc.watchdog, rc.timeouts))  # unit: fault_tolerance
    checks.append(lambda: ft.checkpoint_problems(ckpt_dir, config.run_dir))  # unit: fault_tolerance
    if all(in_bounds(s) for s in (config.model, p, t)):  # the layout: no search over an absurd value's divisors
        checks.append(lambda: layout_problems(config, world))
    for run_check in checks:
        try:
            found += run_check()
        except (ArithmeticError, TypeError, ValueError):  # it tripped over a value its bound refuses already
            if not found:
                raise
    return found


def _seq_len_problems(config: Config) -> List[str]:
    t, m = config.training, config.model
    return [] if t.seq_len <= m.max_seq_len else [
        f"training.seq_len={t.seq_len} is above the model's maximum model.max_seq_len={m.max_seq_len}; lower "
        "training.seq_len or raise model.max_seq_len"]


def _best_metric_problems(config: Config) -> List[str]:
    c, d, e = config.checkpoint, config.data, config.eval
    if c.best_metric != "val_loss" or c.keep_best == 0 or (str(d.validation).strip() != "none" and e.interval > 0):
        return []
    return [f"checkpoint.best_metric=val_loss ranks checkpoints by their validation loss, but this run does not "
            f"evaluate (data.validation={d.validation}, eval.interval={e.interval}); set data.validation and "
            "eval.interval > 0, or choose best_metric loss or probe_loss"]


def layout_at(config: Config, world_size: int) -> List[str]:
    """The layout at ``world_size`` ranks: the mesh, the tensor-parallel fit and the batch split (under
    parallel.fault_tolerance with preserve_batch, the split at every number of groups a quorum may have)."""
    p, t = config.parallel, config.training
    found = p.layout_problems(world_size, config.model, t.seq_len)
    if not found and not config.dry_run:  # a plan is about memory: the micro batch is the user's to adjust after it
        dp = p.layout(world_size).dp
        counts = range(1, 2)  # data-parallel groups of dp ranks in a step
        if p.fault_tolerance.enabled:  # unit: fault_tolerance
            counts = p.fault_tolerance.quorum_sizes()
        for count in counts:
            try:
                make_batch_plan(t.global_batch_size, t.micro_batch_size, dp * count)
            except ValueError as exc:
                found.append(str(exc) if count == 1 else f"with {count} replica groups of {dp} data-parallel "
                             f"ranks in a step's quorum (parallel.fault_tolerance): {exc}")
                break
    return found


NEAREST_TRIED = 4096  # candidate world sizes tried each way for a refusal's nearest that work


def nearest_working(config: Config, world_size: int) -> List[int]:
    """The world sizes nearest ``world_size``, below and above it, that run this layout (none, one or two).
    Every mesh is a multiple of dp_replicate x tp ranks: only those are tried, at most NEAREST_TRIED each way
    and up to twice ``world_size``."""
    unit = config.parallel.dp_replicate * config.parallel.tp
    below = range((world_size - 1) // unit * unit, 0, -unit)
    above = range((world_size // unit + 1) * unit, 2 * world_size + 1, unit)
    return [n for side in (below, above)
            for n in itertools.islice((m for m in side[:NEAREST_TRIED] if not layout_at(config, m)), 1)]


def layout_problems(config: Config, world: World) -> List[str]:
    """The layout once the world size is known; for an elastic range at its largest world size, the group
    torchrun forms once every node joined. A refused world size names the nearest that work: a group torchrun
    re-formed at it (an elastic range after a node was lost) is refused again on every restart."""
    if world is None:
        return []
    if not isinstance(world, tuple):
        found = layout_at(config, world)
        near = nearest_working(config, world) if found else []
        if near:
            found.append(f"world size {world} cannot run this layout; the nearest that can: "
                         f"{' and '.join(map(str, near))} ranks. Launch a node count that gives one of them: a "
                         "torchrun --nnodes range must hold only such counts, or a group re-formed at another "
                         "stops here (exit 2) on every restart")
        return found
    largest = world[-1]
    found = layout_at(config, largest)
    if not found:
        return []
    works = [n for n in world[:-1] if not layout_at(config, n)]
    which = f"world sizes {works} of the range work" if works else "no world size of the range works"
    where = (f"at world size {largest}, the largest of the elastic range {world[0]} to {largest} (the group "
             f"torchrun forms once every node joined; {which}): ")
    return [where + message for message in found]


def warnings(config: Config, world: World) -> List[str]:
    """Settings that work but can never do what they seem to ask (printed, not refused)."""
    out = []
    c, steps = config.checkpoint, config.training.steps
    interval = c.every
    if c.keep_every > 0 and interval != "auto" and interval > 0 and c.keep_every % interval:
        both = math.lcm(c.keep_every, interval)
        when = (f"only steps divisible by {both} are kept" if both <= steps else
                f"no save of this run (training.steps={steps}) is kept, unless the final one")
        out.append(f"checkpoint.keep_every={c.keep_every} is not a multiple of checkpoint.interval={interval}: "
                   f"saves fall on multiples of {interval}, so {when}; set keep_every to a multiple of interval")
    if isinstance(world, tuple) and not layout_at(config, world[-1]):
        failing = [(n, found) for n in world[:-1] for found in [layout_at(config, n)] if found]
        if failing:
            bad = [n for n, _ in failing]
            works = [n for n in world if n not in bad]
            per_node = world[1] - world[0]  # the launcher's sizes: each node count of the range x its processes
            low = world[-1]
            while low - per_node in works:
                low -= per_node
            nnodes = (f"{world[-1] // per_node} (min = max)" if low == world[-1] else
                      f"{low // per_node}:{world[-1] // per_node}")
            out.append(f"world sizes {bad} of the elastic range {world[0]} to {world[-1]} cannot run this layout, so "
                       f"a group re-formed at one of them (after a node is lost) stops with exit 2 on every restart "
                       f"(at {failing[0][0]}: {failing[0][1][0]}); the range's world sizes that work: {works}; "
                       f"launch with --nnodes {nnodes}, or choose training.global_batch_size and "
                       "training.micro_batch_size that every data-parallel size of the range divides")
    return out
