"""Run by the checkpoint resume/reshard tests (support/resume.py): train.py with test-only hooks that may kill it.

The hooks are never part of the trainer itself.

  python tests/support/workers/ckpt_runner.py [--drop COMPONENT] [--kill-after-save STEP] [--kill-before-commit STEP]
                                      [--scaler-growth-interval N] -- <hydra overrides>

--drop leaves one component out of the checkpoint resumed from (it is not read at load; later
saves are complete), to show that the component is needed;
--kill-after-save SIGKILLs the process right after the save of STEP returned to the loop
(sync: committed; async: snapshot taken, write in flight); --kill-before-commit SIGKILLs it
after every rank's files are written and acknowledged but before the commit rename.
Works under torchrun too (the same interventions on every rank).
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--drop", default=None)
    p.add_argument("--kill-after-save", type=int, default=None)
    p.add_argument("--kill-before-commit", type=int, default=None)
    p.add_argument("--scaler-growth-interval", type=int, default=None)
    a, overrides = p.parse_known_args(sys.argv[1:])  # torchrun drops the "--" separator
    overrides = [o for o in overrides if o != "--"]

    import checkpoint.durable.saver as saver
    import checkpoint.manager as manager
    import checkpoint.state.training_state as state

    if a.drop:  # the component is not read from the checkpoint: as if it had never been saved
        original_sd, original_load = state.TrainingState.state_dict, manager.load_checkpoint
        loading = [False]

        def state_dict_without(self):
            sd = original_sd(self)
            if loading[0]:
                sd.pop(a.drop)
            return sd

        def load_without(*args, **kwargs):
            loading[0] = True
            try:
                return original_load(*args, **kwargs)
            finally:
                loading[0] = False

        state.TrainingState.state_dict = state_dict_without
        manager.load_checkpoint = load_without

    if a.kill_after_save is not None:
        original_save = manager.CheckpointManager.save

        def save_then_die(self, step, loss, *args, **kwargs):
            original_save(self, step, loss, *args, **kwargs)
            if step == a.kill_after_save:
                _die()

        manager.CheckpointManager.save = save_then_die

    if a.kill_before_commit is not None:
        original_commit = saver.commit_checkpoint

        def die_before_commit(uncommitted, final, *rest):
            if uncommitted.name.startswith(f"step_{a.kill_before_commit:08d}"):
                _die()
            return original_commit(uncommitted, final, *rest)

        saver.commit_checkpoint = die_before_commit

    if a.scaler_growth_interval is not None:
        import torch

        from training import step

        original_init = step.Precision.__init__

        def precision_init(self, mode, device):
            original_init(self, mode, device)
            if self.scaler is not None:
                self.scaler = torch.amp.GradScaler(device.type, growth_interval=a.scaler_growth_interval)

        step.Precision.__init__ = precision_init

    sys.argv = [str(ROOT / "train.py"), *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
