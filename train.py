"""Train a Llama-style model: compose the Hydra config, check it, run it.

  python train.py +experiment=debug                       # CPU, ~20 s on 2 idle cores
  torchrun --nproc-per-node 8 train.py +experiment=70b    # see README for multi-node
  python train.py +experiment=70b dry_run=true            # compose and plan, no allocation

The run itself (build the parts, resume, the loop, shutdown) reads top to bottom in
trainer/run.py. Nothing imports this file.
"""

from __future__ import annotations

import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from checkpoint.durable.lease import LiveOwner
from checkpoint.durable.manifest import CheckpointError, ConfigMismatch
from checkpoint.durable.preflight import PreflightError
from configs.keys import ConfigError
from data.prepared import DataError
from model.counting import count_params, flops_per_token
from recovery.guards.rollback import RollbackError  # unit: guards
from recovery.verify import RecoveryError
from trainer.config import Config, register
from trainer.preflight import CONFIG_CHECKED_ENV, check, world_size_of
from trainer.run import run

register()

# Errors whose message says what is wrong and what to do: printed as one block, no traceback.
# Exit code 2: the configuration (or a resume's change of it, or a launch into a live run) is refused; 1: the
# run could not go on
# (CheckpointError covers a save the storage refused, CheckpointSaveError, and a stale writer, StaleWriter).
USER_ERRORS = (ConfigError, CheckpointError, PreflightError, RecoveryError, DataError)
USER_ERRORS += (RollbackError,)  # unit: guards
CONFIG_EXIT_CODE = 2
SILENT_RANK_WAIT_S = 3.0
_composed = False  # set once Hydra has composed the config and called main


def dry_run(config: Config) -> None:
    """Print the composed config, the model's size and the per-rank plan of the parallel layout (planner/plan.py:
    an estimate, imported here only, since a training run never needs it); nothing is allocated."""
    from planner.plan import format_plan, plan_from_config

    mcfg = config.model
    params = count_params(mcfg)
    print(OmegaConf.to_yaml(OmegaConf.structured(config)))
    tokens_per_step = config.training.global_batch_size * config.training.seq_len
    print(f"model {mcfg.name}: {params.total:,} parameters ({params.total / 1e9:.2f} B), "
          f"{params.non_embedding:,} without embeddings")
    print(f"tokens per step: {tokens_per_step:,}; training FLOPs per token: "
          f"{flops_per_token(mcfg, config.training.seq_len):.3e}")
    if config.parallel.dp_shard == -1 and "WORLD_SIZE" not in os.environ:
        print("per-rank plan: give the layout (e.g. parallel.dp_shard=64 parallel.tp=8) or WORLD_SIZE; "
              "scripts/plan.py also takes the host-copy and storage bandwidths")
        return
    print(format_plan(plan_from_config(config, int(os.environ.get("WORLD_SIZE", 0)) or None)))


def _prints(exc: BaseException) -> bool:
    """Whether this process prints ``exc``'s block. A refusal every rank agreed on (trainer/preflight.py
    marks it ``agreed``): rank 0 alone. A config refused before the process group (the device, checked on
    each host): the first rank of each node. Any other error: the rank that met it."""
    if getattr(exc, "agreed", False):
        return os.environ.get("RANK", "0") == "0"
    return os.environ.get("LOCAL_RANK", "0") == "0" or not isinstance(exc, ConfigError)


def _report(exc: BaseException) -> None:
    """A user error's message, once, by the rank that prints it (the run calls this before its shutdown)."""
    if isinstance(exc, USER_ERRORS) and _prints(exc) and not getattr(exc, "reported", False):
        rank = None if getattr(exc, "agreed", False) else os.environ.get("RANK")  # agreed: every rank's
        print(f"\nerror{f' (rank {rank})' if rank else ''}: {type(exc).__name__}: {exc}\n", file=sys.stderr,
              flush=True)
        exc.reported = True


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    global _composed
    _composed = True
    try:
        if cfg.check_only or cfg.dry_run:  # one process, no process group: every check here
            config, warnings = check(cfg, world_size_of(cfg), files=True)
            for warning in warnings:
                if not os.environ.get(CONFIG_CHECKED_ENV):  # the launcher's own check printed it
                    print(f"warning: {warning}", file=sys.stderr)
            if cfg.check_only:
                print("configuration accepted", file=sys.stderr)
                return
            dry_run(config)
            return
        run(cfg, list(HydraConfig.get().overrides.task), report=_report)  # checks the launch (trainer/preflight.py)
    except USER_ERRORS as exc:
        if not _prints(exc):  # the agent stops every rank once one exits: leave the printing rank time to print
            time.sleep(SILENT_RANK_WAIT_S)
        else:
            _report(exc)  # unless the run did, before its shutdown
        sys.exit(CONFIG_EXIT_CODE if isinstance(exc, (ConfigError, ConfigMismatch, LiveOwner)) else 1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exit_:
        # Hydra prints a config it cannot compose (an unknown key, a wrong type) as one block and exits 1
        # before main runs: that too is a configuration error.
        if exit_.code == 1 and not _composed:
            sys.exit(CONFIG_EXIT_CODE)
        raise
