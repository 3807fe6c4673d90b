"""Every exit path of a run closes what it opened: the async checkpoint writer (its save
commits), the data workers, the watchdog (thread and faulthandler timer), the preemption
signal handlers and the process group. Runs in this process so that what is left behind
(threads, child processes, handlers) can be seen."""

from __future__ import annotations

import multiprocessing
import signal
import threading

import pytest
import torch.distributed as dist

from checkpoint.durable.discovery import list_committed
from recovery.faults import InjectedFault
from rehearsal.runs import debug_overrides
from rehearsal.supervisor import compose
from trainer.run import run


def _leftovers():
    threads = sorted(t.name for t in threading.enumerate()
                     if t.name.startswith(("watchdog", "checkpoint-persist", "checkpoint-retention")))
    return {"threads": threads, "children": multiprocessing.active_children(),
            "sigterm": signal.getsignal(signal.SIGTERM), "process_group": dist.is_initialized()}


CLEAN = {"threads": [], "children": [], "sigterm": signal.SIG_DFL, "process_group": False}


@pytest.mark.parametrize("ending", ["exception_in_a_step", "normal"])
def test_every_exit_path_closes_writer_workers_watchdog(tmp_path, pydoc_data, ending):
    assert _leftovers() == CLEAN
    extra = {"checkpoint.interval": 4, "checkpoint.async_mode": "async", "data.num_workers": 2,
             "recovery.watchdog": "true"}
    if ending == "exception_in_a_step":
        extra["+recovery.faults"] = "[{kind: exception, phase: step, step: 5}]"
    cfg = compose(debug_overrides(tmp_path / "run", pydoc_data, steps=6, extra=extra))
    if ending == "normal":
        run(cfg, [])
    else:
        with pytest.raises(InjectedFault, match="step 5"):
            run(cfg, [])
    assert _leftovers() == CLEAN
    committed = [c.step for c in list_committed(tmp_path / "run" / "checkpoints")]
    assert committed == ([6, 4] if ending == "normal" else [4])  # the save in flight at the error committed
