"""The processes that tests, benchmarks and the local S3 server start and stop, handled one way: a free
port for a rendezvous or a server, the environment of a child, and the kill of a whole process tree.

A tree, not a process group: torchrun starts each worker in a session of its own, so killing the
agent's group leaves the workers running (until their death signal, parallel/init.py), and a test or
a benchmark that stops a "node" must take the workers with it at once.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def _ephemeral_range() -> Tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_PORT_FLOOR = 20000  # below: ports that services are commonly configured on
_MIN_POOL = 1000  # ports a pool needs, or it is not used
_next_pick: Dict[int, int] = {}  # pid -> next offset: a forked child starts its own sequence


def _pool() -> Optional[Tuple[int, int]]:
    """[first, last) of the ports to pick from: below the ephemeral range, else above it; None if neither is
    large enough."""
    low, high = _ephemeral_range()
    for first, last in ((_PORT_FLOOR, low), (high + 1, 65536)):
        if last - first >= _MIN_POOL:
            return first, last
    return None


def free_port(count: int = 1) -> int:
    """A TCP port that nothing is bound to now on any IPv4 address, for a child process to bind later (on
    127.0.0.1 in the tests); with ``count``, the first of that many consecutive ones (a launcher that puts group g
    at PORT + g).

    Picked outside the kernel's ephemeral range (below it, else above it): the kernel hands ports in that range to
    every bind to port 0 and every outgoing connection (gloo's listeners, store clients, other tests' servers), so
    a port picked there could be taken in the second before the child bound it. That happened in CI: a torchrun
    agent's rendezvous store failed to bind, and its peer node talked to a stranger. Outside the range only
    another explicit pick can take it: this process's picks never repeat (a sequence from a random start, so
    concurrent processes start far apart), and a port bound by anyone is skipped."""
    pool = _pool()
    if pool is None:  # an ephemeral range that leaves no room: the kernel's pick, with its race
        if count != 1:
            raise RuntimeError(f"no room outside the ephemeral range {_ephemeral_range()} for {count} ports")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    base, span = pool[0], pool[1] - pool[0] - count
    pid = os.getpid()
    if pid not in _next_pick:
        _next_pick.clear()
        _next_pick[pid] = random.SystemRandom().randrange(span)
    for _ in range(span):
        first = base + _next_pick[pid] % span
        _next_pick[pid] += count
        if all(_bindable(port) for port in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} free consecutive TCP port(s) in {pool[0]}-{pool[1] - 1}")


def _bindable(port: int) -> bool:
    """Nothing is bound to ``port`` on any IPv4 address (a listener on one address would take a child's bind on
    the wildcard, which torchrun's store and torchft use)."""
    try:
        with socket.socket() as s:
            s.bind(("", port))
        return True
    except OSError:
        return False


def wait_listening(proc: subprocess.Popen, port: int, what: str, timeout_s: float = 60.0) -> None:
    """Return once ``proc`` (or a process it started) listens on ``port``; raise if it exits first or ``timeout_s``
    passes. A server started and handed to clients at once races them: the Lighthouse takes 1.8 s to listen on an
    idle machine (it imports torch), and under load a group's 3 s connect timeout ran out before it (CI). Asked of
    the process's own sockets, not by connecting: a stranger that took the port would answer a connect."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if any(port in (p for _, p in listening(pid)) for pid in (proc.pid, *descendants(proc.pid))):
                return
        except OSError:  # exited meanwhile
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before it listened on port {port}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen on port {port} within {timeout_s:.0f} s")
        time.sleep(0.05)


def listening(pid: int) -> List[Tuple[str, int]]:
    """(address, port) of every TCP socket that process ``pid`` holds open in the LISTEN state: its fds' socket
    inodes, looked up in /proc/<pid>/net/tcp and tcp6 (the network namespace's table, addresses in hex)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # /proc writes each 32-bit word
            found.append((socket.inet_ntop(family, raw), int(hex_port, 16)))  # in host (little-endian) order
    return found


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment for a child: one OpenMP thread and wandb off unless the caller set
    them (a shared machine's cores are not the child's alone), then ``extra``."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("WANDB_MODE", "disabled")
    env.update(extra or {})
    return env


def _children_by_parent() -> Dict[int, List[int]]:
    """Every live process's pid under its parent's (zombies left out: they are gone, only unreaped)."""
    out: Dict[int, List[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, ppid = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            out.setdefault(int(ppid), []).append(int(name))
    return out


def children(pid: int) -> List[int]:
    """The live processes whose parent is ``pid``."""
    return _children_by_parent().get(pid, [])


def descendants(pid: int) -> List[int]:
    """Every live process below ``pid``, children first."""
    tree = _children_by_parent()
    out, todo = [], [pid]
    while todo:
        below = tree.get(todo.pop(0), [])
        out += below
        todo += below
    return out


def kill_tree(*pids: int) -> None:
    """SIGKILL each of ``pids`` and every process below it. The tree is read before the first kill (a
    killed parent's children move to another parent), and the process group a pid leads (a child
    started with start_new_session) goes too, which catches what left the tree."""
    doomed = [p for pid in pids for p in (pid, *descendants(pid))]
    for pid in pids:
        try:
            if os.getpgid(pid) == pid != os.getpgrp():
                os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
