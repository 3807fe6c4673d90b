"""The tests' warm parent: import torch and the trainer once, then fork every run a test asks for.

Each python process a test starts pays ~5-7 s of CPU before its first line of work (``import torch``,
DCP, DTensor, torch._dynamo on the meta device); with hundreds of runs that was most of the suite.
This server pays it once per test session. A run it forks is a real process with its own pid,
its own files and its own exit status, killed by a real SIGKILL: what the tests assert about a
run does not depend on how it was started. What a fork cannot give is asserted where it matters
with real launches: torchrun's agent (restarts, rendezvous, SIGTERM through the agent, orphans)
is tested with torchrun itself, and a cold start with plain python (tests/integration/test_recovery_launch.py).

Protocol (one SOCK_SEQPACKET connection per run; tests/support/warm.py is the client):
  client -> server   one message: JSON {argv, env, cwd, nproc} with fds 0, 1, 2 for the run
  server -> client   {"pid": P}, then {"returncode": R} when the run ends (-N: killed by signal N)
``argv`` is a script and its arguments (``["train.py", ...]``) or ``["-m", module, ...]``. With
``nproc`` > 1 the run is a launcher that forks ``nproc`` ranks with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT on a fresh port) and, like
torchrun, stops every rank when one fails and exits 1; each rank dies with it (PR_SET_PDEATHSIG).

The server must not run torch ops itself: no OpenMP pool exists when it forks.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import importlib.util
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
import traceback

from rehearsal.processes import free_port, kill_tree

PR_SET_PDEATHSIG = 1
RANK_STOP_GRACE_S = 30.0  # as torchrun's agent: SIGTERM the other ranks, SIGKILL after this
WARM_MODULES = ("trainer.run", "torch.distributed.checkpoint", "torch._dynamo")


def warm_imports(root: str) -> None:
    """What train.py and the trainer import, plus what torch imports lazily on first use."""
    for name in WARM_MODULES:
        importlib.import_module(name)
    # train.py itself, as a module (its main runs only as __main__): everything it imports
    spec = importlib.util.spec_from_file_location("_warm_train", os.path.join(root, "train.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _fresh_stdio() -> None:
    """Standard streams as a new interpreter makes them for these fds and this environment:
    stdout block-buffered (line-buffered on a terminal), stderr line-buffered, both unbuffered
    with PYTHONUNBUFFERED."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name, errors in ((0, "stdin", "strict"), (1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        raw = open(fd, "rb" if fd == 0 else "wb", buffering=0 if unbuffered and fd else -1, closefd=False)
        tty = os.isatty(fd)
        stream = io.TextIOWrapper(raw, encoding=getattr(sys, f"__{name}__").encoding, errors=errors,
                                  line_buffering=fd == 2 or tty, write_through=unbuffered and fd > 0)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter does with ``sys.exit(x)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """Leave as the interpreter would: join non-daemon threads, run atexit, flush; never return."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def run_program(argv: list) -> None:
    """Run ``argv`` as ``python argv...`` would, in this process; never return."""
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code)


def launch_ranks(argv: list, nproc: int) -> None:
    """torchrun --standalone for one node, forked: start the ranks, wait; on the first failure stop
    the others (SIGTERM, then SIGKILL after the grace) and exit 1; SIGTERM/SIGINT are passed on."""
    port = free_port()
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _die_with_parent()
            os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                               "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            run_program(argv)
        ranks[pid] = rank

    def pass_on(signum, _frame):
        for pid in ranks:
            _kill(pid, signum)
    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)

    failed = False
    stop_deadline = None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                for other in ranks:
                    _kill(other, signal.SIGKILL)
                stop_deadline = None
            time.sleep(0.01)
            continue
        rank = ranks.pop(pid, None)
        if rank is None:
            continue
        rc = os.waitstatus_to_exitcode(status)  # -N when killed by signal N
        if rc != 0 and not failed:
            failed = True
            print(f"warm launcher: rank {rank} (pid {pid}) exited with {rc}; stopping the other ranks",
                  file=sys.stderr, flush=True)
            for other in ranks:
                _kill(other, signal.SIGTERM)
            stop_deadline = time.monotonic() + RANK_STOP_GRACE_S
    os._exit(1 if failed else 0)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def start_run(request: dict, fds: list, listener: socket.socket, conns: list) -> int:
    """Fork the run; in the child, become it (fds, cwd, environment, signals) and never return."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setpgid(0, 0)  # the server can stop a run and all its ranks at once
        _die_with_parent()
        listener.close()
        for c in conns:
            c.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_stdio()
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            import torch

            torch.set_num_threads(int(threads))  # read at import: apply the run's own setting
        if request.get("nproc", 1) > 1:
            launch_ranks(request["argv"], request["nproc"])
        run_program(request["argv"])
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for this name: the server is warm and listening
    conns: list = []
    runs: dict = {}  # pid -> connection

    def stop_all(*_):
        kill_tree(*runs)
        os._exit(0)
    signal.signal(signal.SIGTERM, stop_all)

    while True:
        readable, _, _ = select.select([listener, *conns], [], [], 0.02)
        for sock in readable:
            if sock is listener:
                conns.append(listener.accept()[0])
                continue
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
            if not msg:  # the client went away: stop its run if it still runs
                for pid, conn in list(runs.items()):
                    if conn is sock:
                        kill_tree(pid)
                conns.remove(sock)
                sock.close()
                continue
            pid = start_run(json.loads(msg), fds, listener, conns)
            for fd in fds:
                os.close(fd)
            runs[pid] = sock
            sock.send(json.dumps({"pid": pid}).encode())
        while runs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = runs.pop(pid, None)
            if conn is None:
                continue
            rc = os.waitstatus_to_exitcode(status)  # -N when killed by signal N
            try:
                conn.send(json.dumps({"returncode": rc}).encode())
            except OSError:
                pass


if __name__ == "__main__":
    _die_with_parent()
    warm_imports(sys.argv[2])
    gc.freeze()  # the imported modules' objects: never scanned or copied by the runs' collections
    serve(sys.argv[1])
