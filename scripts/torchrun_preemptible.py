"""torchrun whose agent passes a preemption notice (SIGTERM, SIGUSR1) on to its workers.

Stock torchrun (torch 2.13) turns SIGTERM into a shutdown: its agent sends SIGTERM to every
worker's process group (data-loader worker processes included), SIGKILLs whatever still runs
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (default 30) and exits 1, however cleanly the
workers saved. SIGUSR1 it does not handle at all: the agent dies of it and the workers never
hear of it. This is torchrun with one change: on SIGTERM or SIGUSR1 the agent sends the same
signal to each worker process (the training process only), keeps monitoring them, and exits
as torchrun does when they finish: 0 when every rank saved, committed and exited 0
(recovery/preemption.py). If they still run TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds after the
first notice (set it above recovery.preemption_grace_s; the launchers in scripts/ do), it
SIGKILLs them and exits non-zero. Every argument, and every other signal, is torchrun's.

  python scripts/torchrun_preemptible.py --standalone --nproc-per-node 8 train.py +experiment=125m

A worker whose agent dies (SIGKILL, OOM) is killed by the kernel (parallel/init.py,
die_with_launcher). Passing --signals-to-handle with SIGTERM or SIGUSR1 gives those back to
torchrun's own handling.

Before it starts any worker it runs train.py's checks once (``check_only=true``, with the world size
the arguments give): a refused config or launch prints its one block and exits 2, with no agent
traceback (stock torchrun would print its ChildFailedError summary and exit 1).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

from torch.distributed.run import main as torchrun_main

NOTICES = (signal.SIGTERM, signal.SIGUSR1)
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # torchrun's default list less the notices
DEFAULT_SHUTDOWN_S = 150  # the default recovery.preemption_grace_s (120) + 30 s


def child_pids(parent: int) -> List[int]:
    """The processes whose parent is ``parent`` (torchrun starts each worker as its child)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            out.append(int(name))
    return out


class NoticeForwarder:
    """Signal handler for the notices: forward to the workers; after ``shutdown_s`` end them."""

    def __init__(self, shutdown_s: float):
        self.shutdown_s = shutdown_s
        self.first_notice: Optional[float] = None

    def install(self) -> None:
        for s in NOTICES:
            signal.signal(s, self.handle)

    def handle(self, signum: int, frame) -> None:
        workers = child_pids(os.getpid())
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        name = signal.Signals(signum).name
        print(f"[torchrun_preemptible] {name}: forwarded to workers {workers}; they save and exit "
              f"(deadline {self.shutdown_s:.0f} s)", file=sys.stderr, flush=True)
        if self.first_notice is None:
            self.first_notice = time.monotonic()
            threading.Thread(target=self._deadline, name="preemption-deadline", daemon=True).start()

    def _deadline(self) -> None:
        time.sleep(self.shutdown_s)
        workers = child_pids(os.getpid())
        print(f"[torchrun_preemptible] workers {workers} still running {self.shutdown_s:.0f} s after the notice "
              "(TORCH_ELASTIC_SHUTDOWN_TIMEOUT): killing them", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's own shutdown: no restart after this
        time.sleep(1.0)
        for pid in workers:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _option(args: List[str], *names: str) -> Optional[str]:
    """The value of a torchrun option (``--name value`` or ``--name=value``) among ``args``."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def check_config(argv: List[str]) -> int:
    """train.py check_only=true with the overrides of the script in ``argv`` (torchrun's arguments); its
    exit status (0 when the script is not train.py: nothing to check)."""
    script = next((i for i, a in enumerate(argv) if a.endswith("train.py")), None)
    if script is None:
        return 0
    launcher = argv[:script]
    nproc, nnodes = _option(launcher, "--nproc-per-node", "--nproc_per_node"), _option(launcher, "--nnodes") or "1"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    if nproc and nproc.isdigit() and nnodes.isdigit():  # elastic (MIN:MAX) or "gpu": the layout is checked later
        env["WORLD_SIZE"] = str(int(nproc) * int(nnodes))
    rdzv_id = _option(launcher, "--rdzv-id", "--rdzv_id") or os.environ.get("PET_RDZV_ID")
    if rdzv_id and "--standalone" not in launcher:  # the job's workers will see it: a requeue of this job
        env["TORCHELASTIC_RUN_ID"] = rdzv_id  # is the same job to the lease check, as it is to the workers
    return subprocess.run([sys.executable, argv[script], *argv[script + 1:], "check_only=true"], env=env).returncode


def main() -> None:
    status = check_config(sys.argv[1:])
    if status != 0:
        sys.exit(status)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(DEFAULT_SHUTDOWN_S))
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", TORCHRUN_SIGNALS)  # torchrun leaves the notices to us
    NoticeForwarder(float(os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])).install()
    torchrun_main()


if __name__ == "__main__":
    main()
