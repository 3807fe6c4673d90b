"""The processes that tests, benchmarks and the local S3 server start and stop, handled one way: a free
port for a rendezvous or a server, the environment of a child, and the kill of a whole process tree.

A tree, not a process group: torchrun starts each worker in a session of its own, so killing the
agent's group leaves the workers running (until their death signal, parallel/init.py), and a test or
a benchmark that stops a "node" must take the workers with it at once.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Dict, List, Optional


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel picks it; another process may take
    it before the caller binds it, which then fails loudly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
