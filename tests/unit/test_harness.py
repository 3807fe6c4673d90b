"""The benchmarks' and the tests' shared process handling (rehearsal/processes.py) and the benchmarks' runs in
turns (rehearsal/bench.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rehearsal.bench import in_turns
from rehearsal.processes import descendants, free_port, kill_tree, wait_listening
from support.processes import alive

# A parent whose child starts a session of its own (as torchrun's workers do) and has a child of its own.
TREE = """
import subprocess, time
subprocess.Popen(["bash", "-c", "sleep 60 & wait"], start_new_session=True)
time.sleep(60)
"""


def test_kill_tree_takes_every_process_below_even_in_another_session():
    root = subprocess.Popen([sys.executable, "-c", TREE], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(descendants(root.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        below = descendants(root.pid)
        assert len(below) == 2, below
    finally:
        kill_tree(root.pid)
        root.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in below)


def test_free_port_can_be_listened_on():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()


def test_free_ports_lie_outside_the_kernels_ephemeral_range_and_do_not_repeat():
    """A port in the ephemeral range can be taken by any bind to port 0 or outgoing connection before the
    child binds it (a CI failure: a rendezvous store could not bind). A forked child, which inherits the
    picker's state, must not hand out its parent's next port."""
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and not [p for p in ports if low <= p <= high], (low, high, ports)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write, str(free_port()).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    assert int(os.read(read, 16)) != free_port()
    os.close(read)


def test_a_block_of_free_ports_is_not_handed_out_again():
    """A launcher that puts group g at PORT + g (scripts/train_fault_tolerant.sbatch) gets a block; the next pick
    (the Lighthouse's port, in CI) must lie outside it, or group 1's rendezvous meets the Lighthouse."""
    first = free_port(count=3)
    block = set(range(first, first + 3))
    later = {free_port() for _ in range(20)}
    assert not block & later, (block, later)
    for port in block:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_wait_listening_waits_for_the_servers_own_socket_and_not_a_strangers():
    """A server that binds late is waited for; a stranger listening on the port does not count (a connect would
    have taken it for the server); a server that exits is reported at once."""
    port = free_port()
    late = f"import socket, time; time.sleep(0.5); s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); " \
           "time.sleep(30)"
    server = subprocess.Popen([sys.executable, "-c", late])
    try:
        started = time.monotonic()
        wait_listening(server, port, "the late server", timeout_s=30)
        assert time.monotonic() - started >= 0.5
    finally:
        server.kill()
        server.wait()
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            with pytest.raises(RuntimeError, match="the idle server did not listen on port"):
                wait_listening(idle, stranger.getsockname()[1], "the idle server", timeout_s=1)
        finally:
            idle.kill()
            idle.wait()
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=rf"^the failing server exited \(3\) before it listened on port {port}$"):
        wait_listening(gone, port, "the failing server", timeout_s=30)


def test_in_turns_calls_each_variant_once_a_round_and_each_goes_first_in_turn():
    calls = []
    out = in_turns({name: (lambda name=name: calls.append(name) or name) for name in "abc"}, rounds=6, shift=1)
    assert out == {name: [name] * 6 for name in "abc"}
    firsts = calls[::3]
    assert firsts == ["b", "c", "a", "b", "c", "a"]
    assert all(sorted(calls[i:i + 3]) == ["a", "b", "c"] for i in range(0, 18, 3))


def test_free_ports_are_picked_above_the_ephemeral_range_when_it_starts_low(monkeypatch):
    import rehearsal.processes as processes

    monkeypatch.setattr(processes, "_ephemeral_range", lambda: (15000, 60999))
    monkeypatch.setattr(processes, "_next_pick", {})
    ports = [free_port() for _ in range(5)] + [free_port(count=2)]
    assert all(60999 < p < 65535 for p in ports), ports
