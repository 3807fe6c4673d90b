"""Runs forked from the tests' warm parent (tests/support/workers/warm_launcher.py), used like subprocess.

``python train.py ...`` costs ~5-7 s of CPU before its first step, nearly all of it imports; a run
forked from the warm parent starts in milliseconds. It is still a real process: its own pid, files,
exit status, and a real SIGKILL. ``torchrun --standalone --nproc-per-node=N script ...`` becomes a
forked launcher of N ranks with torchrun's environment (see the worker's docstring for what it
does and does not imitate); tests of torchrun itself use ``support.launch.torchrun`` and subprocess.

The parent starts on first use, once per test session (per pytest process), and stops with it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence, Tuple

from rehearsal.processes import kill_tree
from support.launch import ROOT, subprocess_env, worker

START_TIMEOUT_S = 180.0


class WarmProcess:
    """One run forked by the warm parent: the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]):
        self._conn = conn
        self.pid = pid
        self.args = list(args)
        self.returncode: Optional[int] = None

    def _receive(self, timeout: Optional[float]) -> bool:
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        msg = self._conn.recv(4096)
        if not msg:
            raise RuntimeError(f"the warm parent went away while running {self.args}; its log: {_server.log}")
        self.returncode = json.loads(msg)["returncode"]
        self._conn.close()
        return True

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._receive(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None and not self._receive(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.poll() is None:
            self.kill()
            self.wait()


class _Server:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="warm-launcher-")
        self.socket = os.path.join(self.dir, "sock")
        self.log = os.path.join(self.dir, "server.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, worker("warm_launcher"), self.socket, str(ROOT)],
                                         cwd=ROOT, env=subprocess_env(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm parent did not start:\n{Path(self.log).read_text()[-4000:]}")
            time.sleep(0.02)
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_server: Optional[_Server] = None


def _parent() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    return _server


def parse(cmd: Sequence[str]) -> Optional[Tuple[List[str], int]]:
    """(argv, nproc) for ``python SCRIPT ...``, ``python -m MODULE ...`` and
    ``python -m torch.distributed.run --standalone --nproc-per-node=N SCRIPT ...``; None otherwise."""
    cmd = list(cmd)
    if not cmd or cmd[0] != sys.executable or len(cmd) < 2:
        return None
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        if len(cmd) < 6 or cmd[3] != "--standalone" or not cmd[4].startswith("--nproc-per-node=") \
                or cmd[5].startswith("-"):  # any other torchrun flag: the agent itself is under test
            return None
        return cmd[5:], int(cmd[4].split("=", 1)[1])
    if cmd[1] == "-m":
        return cmd[1:], 1
    return (cmd[1:], 1) if not cmd[1].startswith("-") else None


def popen(cmd: Sequence[str], stdout: IO | int | None = None, stderr: IO | int | None = None,
          env: Dict[str, str] | None = None, cwd: os.PathLike | str = ROOT) -> WarmProcess:
    """Start ``cmd`` (see ``parse``) forked from the warm parent. ``stdout``/``stderr``: open files
    (or fds); ``stderr=subprocess.STDOUT`` joins them; None: this process's own."""
    parsed = parse(cmd)
    if parsed is None:
        raise ValueError(f"not a command the warm parent runs: {cmd}")
    argv, nproc = parsed
    out = sys.stdout.fileno() if stdout is None else (stdout if isinstance(stdout, int) else stdout.fileno())
    err = out if stderr == subprocess.STDOUT else (
        sys.stderr.fileno() if stderr is None else (stderr if isinstance(stderr, int) else stderr.fileno()))
    request = {"argv": argv, "nproc": nproc, "cwd": str(cwd), "env": env if env is not None else subprocess_env()}
    with open(os.devnull) as null:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(_parent().socket)
        socket.send_fds(conn, [json.dumps(request).encode()], [null.fileno(), out, err])
    reply = conn.recv(4096)
    if not reply:
        raise RuntimeError(f"the warm parent could not start {cmd}; its log: {_server.log}")
    return WarmProcess(conn, json.loads(reply)["pid"], cmd)


def run(cmd: Sequence[str], timeout: float = 600, env: Dict[str, str] | None = None,
        cwd: os.PathLike | str = ROOT) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)``, forked from the warm parent."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def _stop_group(proc: WarmProcess) -> None:
    """Kill a run and its ranks."""
    kill_tree(proc.pid)
    proc.wait()
