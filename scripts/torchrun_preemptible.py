"""torchrun whose agent passes a preemption notice (SIGTERM, SIGUSR1) on to its workers.

Stock torchrun (torch 2.13) turns SIGTERM into a shutdown: its agent sends SIGTERM to every
worker's process group (data-loader worker processes included), SIGKILLs whatever still runs
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (default 30) and exits 1, however cleanly the
workers saved. SIGUSR1 it does not handle at all: the agent dies of it and the workers never
hear of it. This is torchrun with one change: on SIGTERM or SIGUSR1 the agent sends the same
signal to each worker process (the training process only), keeps monitoring them, and exits
as torchrun does when they finish: 0 when every rank saved, committed and exited 0
(Preemption in recovery/runtime.py). If they still run TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds after the
first notice (set it above recovery.preemption_grace_s; the launchers in scripts/ do), it
SIGKILLs them and exits non-zero. Every argument, and every other signal, is torchrun's.

  python scripts/torchrun_preemptible.py --standalone --nproc-per-node 8 train.py +experiment=125m

A worker whose agent dies (SIGKILL, OOM) is killed by the kernel (parallel/init.py,
die_with_launcher). Passing --signals-to-handle with SIGTERM or SIGUSR1 gives those back to
torchrun's own handling.

Before it starts any worker it runs train.py's checks once (``check_only=true``, with the world size
the arguments give): a refused config or launch prints its one block and exits 2, with no agent
traceback (stock torchrun would print its ChildFailedError summary and exit 1).

A launch that may span nodes (not --standalone, --nnodes above 1) runs with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (``multi_node_env``): in torch 2.13's shared store a replacement
node's agent never completes a rendezvous (tests/integration/test_replacement_node.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Tuple

from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    _parse_rendezvous_config,
    parse_rendezvous_endpoint,
)
from torch.distributed.run import determine_local_world_size, parse_args, parse_min_max_nnodes
from torch.distributed.run import main as torchrun_main

from trainer.preflight import CHECK_WORLD_SIZES_ENV, CONFIG_CHECKED_ENV

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


def _prints_the_check(args) -> bool:
    """Whether this agent prints the config check's block: under a multi-node launch one agent does (SLURM's node
    0, the static rendezvous' --node-rank 0, or the agent on the c10d rendezvous host, as torchrun picks its store
    host); where none can be told (the store runs elsewhere), every agent prints."""
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.standalone or max_nodes == 1:
        return True
    if os.environ.get("SLURM_NODEID") is not None:
        return os.environ["SLURM_NODEID"] == "0"
    if args.rdzv_backend == "static":
        return int(args.node_rank) == 0
    if "is_host=false" in args.rdzv_conf.replace(" ", "").lower() or not args.rdzv_endpoint:
        return True
    try:
        host, _ = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    except ValueError:  # torchrun reports it
        return True
    return _matches_machine_hostname(host)


def _world(args) -> Tuple[List[int], int]:
    """The world sizes the workers may form (one per node count of an elastic --nnodes=MIN:MAX) and the processes
    per node, as torchrun resolves them (--nproc-per-node=gpu: the devices it sees). ValueError: not a layout, or
    a rendezvous option torchrun cannot read."""
    try:
        nproc = determine_local_world_size(args.nproc_per_node)
        low, high = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"--nproc-per-node={args.nproc_per_node} --nnodes={args.nnodes}: {exc} (a count, or for "
                         "--nproc-per-node gpu, cpu or auto; --nnodes a count or MIN:MAX)") from exc
    if not 1 <= low <= high or nproc < 1:
        raise ValueError(f"--nproc-per-node={args.nproc_per_node} --nnodes={args.nnodes}: give at least one process "
                         "and one node (--nnodes MIN:MAX with MIN <= MAX)")
    try:  # what torchrun would otherwise stop on with a traceback once the check passed
        if args.rdzv_endpoint:
            parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        conf = _parse_rendezvous_config(args.rdzv_conf)
    except ValueError as exc:
        raise ValueError(f"--rdzv-endpoint={args.rdzv_endpoint} --rdzv-conf={args.rdzv_conf}: {exc}") from exc
    counts = [f"{k}={v}" for k, v in conf.items() if k.endswith(("timeout", "interval", "attempt"))
              and not v.strip().isdigit()]
    if counts:
        raise ValueError(f"--rdzv-conf={args.rdzv_conf}: {', '.join(counts)} must be whole numbers (torchrun reads "
                         "them with int(); JOIN_TIMEOUT_S for scripts/launch_multi_node.sh)")
    return [n * nproc for n in range(low, high + 1)], nproc


def check_config(argv: List[str]) -> int:
    """train.py check_only=true with the overrides of the script in ``argv`` (torchrun's arguments), at the world
    size(s) and processes per node the arguments give; its exit status (0 when the script is not train.py:
    nothing to check). One agent of a multi-node job prints the block; the others say in one line that they
    refused too."""
    args = parse_args(argv)
    if not args.training_script.endswith("train.py"):
        return 0
    try:
        sizes, nproc = _world(args)
    except ValueError as exc:
        print(f"\nerror: {exc}\n", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", CHECK_WORLD_SIZES_ENV,
                        CONFIG_CHECKED_ENV)}
    env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"] = str(sizes[0]), str(nproc)  # each rank then takes a device
    if len(sizes) > 1:  # elastic: the layout and the batch split must work at every node count of the range
        env[CHECK_WORLD_SIZES_ENV] = ",".join(map(str, sizes))
    if not args.standalone:  # the job's workers will see its id: a requeue of this job is the same job to the
        env["TORCHELASTIC_RUN_ID"] = args.rdzv_id  # lease check, as it is to the workers
    cmd = [sys.executable, args.training_script, *args.training_script_args, "check_only=true"]
    if _prints_the_check(args):
        return subprocess.run(cmd, env=env).returncode
    status = subprocess.run(cmd, env=env, capture_output=True, text=True).returncode
    if status != 0:
        print(f"[torchrun_preemptible] {socket.gethostname()}: the configuration check refused this launch here "
              f"too (exit {status}); the first node prints why. This node's own block: WORLD_SIZE={sizes[0]} "
              f"LOCAL_WORLD_SIZE={nproc} {' '.join(cmd)}", file=sys.stderr, flush=True)
    return status


def multi_node_env(argv: List[str], environ=os.environ) -> Optional[str]:
    """Set what a launch that may span nodes needs in ``environ`` (the agent's, which its workers inherit);
    a notice for the operator when GLOO_SOCKET_IFNAME is unset, else None.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each rendezvous round's rank-0 agent then picks the address
    of the workers' store (a free port on its host), which every agent of the round reads from the
    round's keys, and worker rank 0 hosts a fresh store there (parallel/init.py). With the store torch
    2.13 shares by default, an agent that joins a running job (a replacement node) waits for an
    address the survivors never publish again, and they for it: both exit after 60 s, on every try.
    Forced, not defaulted: without it no node of the job can ever be replaced."""
    args = parse_args(argv)
    try:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        return None  # torchrun reports it
    if args.standalone or max_nodes == 1:
        return None
    environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if environ.get("GLOO_SOCKET_IFNAME") or not _prints_the_check(args):
        return None
    return ("[torchrun_preemptible] GLOO_SOCKET_IFNAME is not set: the gloo groups (control values, checkpoint "
            "agreement, memory tier) use the interface this host's name resolves to; set it on every node to the "
            "interface the nodes reach each other on (docs/recovery-runbook.md, \"Multi-node jobs: what to set\")")


def main() -> None:
    status = check_config(sys.argv[1:])
    if status != 0:
        sys.exit(status)
    notice = multi_node_env(sys.argv[1:])
    if notice:
        print(notice, file=sys.stderr, flush=True)
    os.environ[CONFIG_CHECKED_ENV] = "1"
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(DEFAULT_SHUTDOWN_S))
    shutdown = os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"].strip()
    if not (shutdown.isdigit() and int(shutdown) > 0):  # torchrun reads it with int()
        print(f"\nerror: TORCH_ELASTIC_SHUTDOWN_TIMEOUT={shutdown!r} must be a whole number of seconds > 0: the time "
              "the workers get after a preemption notice (set it above recovery.preemption_grace_s, or unset it "
              "for the launchers' grace + 30 s)\n", file=sys.stderr)
        sys.exit(2)
    shutdown_s = float(shutdown)
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", TORCHRUN_SIGNALS)  # torchrun leaves the notices to us
    NoticeForwarder(shutdown_s).install()
    torchrun_main()


if __name__ == "__main__":
    main()
