"""Run by test_s3_protocol.py under torchrun: every rank builds the CheckpointManager on an S3 prefix
(CKPT_ROOT) of many committed checkpoints, resumes (checkpoint.resume=auto), then rolls back as the guards
do after an alarm at ROLLBACK_FROM; the process group's collectives time out after COLLECTIVE_TIMEOUT_S.

  CKPT_ROOT=s3://checkpoints/many COLLECTIVE_TIMEOUT_S=10 ROLLBACK_FROM=401 OUT_DIR=/tmp/x \\
      torchrun --standalone --nproc-per-node 2 tests/support/workers/s3_rollback_ranks.py

Each rank writes OUT_DIR/rank<R>.json: the S3 requests it made in each phase ({phase: {operation: n}}: start,
the lease and pre-flight; resume; rollback; close, the manager's end with retention), the seconds each took,
and the step it resumed from and rolled back to.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the support package

from checkpoint.storage.s3 import store  # noqa: E402
from parallel import collectives  # noqa: E402
from recovery.guards.rollback import RollbackRequested, roll_back  # noqa: E402
from recovery.resume import resume  # noqa: E402
from support.s3 import manager, protocol_config, tiny_state  # noqa: E402


def main() -> None:
    timeout_s = float(os.environ["COLLECTIVE_TIMEOUT_S"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    collectives.init_control_group(timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = protocol_config(os.environ["CKPT_ROOT"], keep_last=1000)
    state = tiny_state(0, trajectory=9)
    requests: dict = {}
    took: dict = {}
    phase = ["start"]

    def count(event_name: str, **kw) -> None:
        requests.setdefault(phase[0], Counter())[event_name.rsplit(".", 1)[-1]] += 1

    made = store.client
    counted: set = set()

    def client():  # every client this process makes (the settings may replace the first) counts
        c = made()
        if id(c) not in counted:
            counted.add(id(c))
            c.meta.events.register("before-send.s3", count)
        return c

    store.client = client
    t0 = time.monotonic()
    with manager(cfg, state, rank=rank, world_size=world) as mgr:  # "start": the lease and the pre-flight
        took["start"] = time.monotonic() - t0
        phase[0] = "resume"
        t0 = time.monotonic()
        resumed = resume(mgr)
        took["resume"] = time.monotonic() - t0
        resumed_step = state.step
        phase[0] = "rollback"
        t0 = time.monotonic()
        guards = SimpleNamespace(cfg=SimpleNamespace(max_rollbacks=3, rollback_min_age_steps=0,
                                                     rollback_prefer_permanent=True),
                                 rollbacks=0, alarms_dir="alarms", after_rollback=lambda: None)
        to = roll_back(RollbackRequested(int(os.environ["ROLLBACK_FROM"]), "the test's alarm"), guards, mgr,
                       SimpleNamespace(skip_samples=lambda n: None))
        took["rollback"] = time.monotonic() - t0
        phase[0] = "close"
    Path(os.environ["OUT_DIR"], f"rank{rank}.json").write_text(json.dumps(
        {"requests": requests, "seconds": took, "resumed": resumed, "resumed_step": resumed_step,
         "rolled_back_to": to}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
