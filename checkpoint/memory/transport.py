"""The memory tier's transport: its own gloo group, the replica exchange and copies streamed to a peer.

Each rank sends its snapshot to ``peer`` (the rank ``local_world_size`` away: the same local rank
on the next node, a ring over nodes) and receives the snapshot of ``source``. Every transfer is
tagged (header: sizes; info: the copy's manifest; prefix: the snapshot's header, index and
pickled components; data: every tensor's bytes in one buffer), and every agreement is a
collective over the group, so a rank that failed never leaves its peer waiting. The group is
the tier's own: its collectives run on the background thread, apart from training's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

import torch

from checkpoint.memory.snapshot import SnapshotError, Staged, checksum_buffer, write_parts
from parallel import collectives

log = logging.getLogger("trainer")

_TAG_HEADER, _TAG_INFO, _TAG_DATA, _TAG_PREFIX = 11, 12, 13, 14


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


class PeerGroup:
    def __init__(self, rank: int, world_size: int, local_world_size: int, replicas: int, timeout_s: float):
        self.rank, self.world_size, self.local_world_size = rank, world_size, max(1, local_world_size)
        self.peer: Optional[int] = None  # who receives this rank's replica
        self.source: Optional[int] = None  # whose replica this rank holds
        if replicas > 0:
            if world_size > self.local_world_size:
                self.peer = (rank + self.local_world_size) % world_size
                self.source = (rank - self.local_world_size) % world_size
            elif rank == 0:
                log.warning("checkpoint.memory.replicas=1 needs more than one node (world %d, %d ranks per node): "
                            "snapshots stay on their own node only", world_size, self.local_world_size)
        self.group = None
        self._recv: Optional[torch.Tensor] = None  # the replica's receive buffer, reused (exchange)
        self.transfer_s = 0.0  # the last exchange's time on the wire
        if collectives.distributed() and world_size > 1:
            self.group = collectives.new_gloo_group(timeout_s)

    def all_ok(self, ok: bool) -> bool:
        """True on every rank iff ``ok`` on every rank (over the tier's group)."""
        if self.group is None:
            return ok
        return not collectives.any_rank(not ok, self.group)

    def gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        return collectives.all_gather_object(obj, self.group)

    def agree(self, problem: Optional[str]) -> Optional[str]:
        """Every rank's problems, joined (naming the ranks that met each, unless all did), if any
        rank has one (else None); the same on every rank."""
        return problem if self.group is None else collectives.agree_on_problems(problem, self.group)

    def exchange(self, staged: Staged, info: dict, d: Path) -> dict:
        """Send this rank's staged snapshot to the peer and receive the source's, then write it to
        ``d`` and check its checksum in that same pass. The bytes go from the staging buffer itself
        (one large contiguous send, not read back from the file) into a receive buffer this group
        keeps from one snapshot to the next: receiving straight into a fresh mapping of the tmpfs
        file took page faults inside the socket copy and measured 3-4x slower than into touched
        memory. A full tmpfs fails the write after the bytes arrived, so the sender is never left
        hanging; the failure is raised then."""
        info_out = torch.frombuffer(bytearray(json.dumps(info).encode()), dtype=torch.uint8)
        prefix_out = torch.frombuffer(bytearray(staged.prefix), dtype=torch.uint8)
        header_out = torch.tensor([info_out.numel(), prefix_out.numel(), staged.region.numel()], dtype=torch.int64)
        header_in = torch.empty(3, dtype=torch.int64)
        collectives.exchange([(header_out, self.peer, _TAG_HEADER)], [(header_in, self.source, _TAG_HEADER)],
                             self.group)
        info_len, prefix_len, region_len = (int(x) for x in header_in)
        info_in = torch.empty(info_len, dtype=torch.uint8)
        prefix_in = torch.empty(prefix_len, dtype=torch.uint8)
        if self._recv is None or self._recv.numel() != region_len:
            self._recv = None
            self._recv = torch.empty(region_len, dtype=torch.uint8)
        region_in = self._recv
        sends = [(info_out, self.peer, _TAG_INFO), (prefix_out, self.peer, _TAG_PREFIX)]
        recvs = [(info_in, self.source, _TAG_INFO), (prefix_in, self.source, _TAG_PREFIX)]
        if staged.region.numel():
            sends.append((staged.region, self.peer, _TAG_DATA))
        if region_len:
            recvs.append((region_in, self.source, _TAG_DATA))
        t0 = time.perf_counter()
        collectives.exchange(sends, recvs, self.group)
        self.transfer_s = time.perf_counter() - t0
        received = json.loads(info_in.numpy().tobytes())
        size_in = prefix_len + region_len
        replica_tmp = d / f"replica-from-{self.source:05d}"
        try:
            _, got = write_parts(replica_tmp, [prefix_in, region_in], received["algorithm"])
        except OSError as exc:
            raise SnapshotError(f"no room for the replica of rank {received['owner']} ({size_text(size_in)}) "
                                f"in {d}: {exc}") from exc
        if got != received["checksum"] or received["size"] != size_in:
            replica_tmp.unlink(missing_ok=True)
            raise SnapshotError(f"replica of rank {received['owner']} step {received['step']} arrived damaged "
                                f"(checksum {got} != {received['checksum']})")
        os.replace(replica_tmp, d / f"rank{received['owner']:05d}.snap")
        return received

    def close(self) -> None:
        self._recv = None

    def send_copy(self, copy: dict, to: int) -> None:
        """Stream one held copy to rank ``to``: header (size, manifest length), manifest, bytes. A copy
        that cannot be read is announced with size -1 so the receiver does not wait for it."""
        try:
            data = torch.from_file(copy["path"], shared=False, size=copy["size"], dtype=torch.uint8)
            meta = torch.frombuffer(bytearray(json.dumps(copy).encode()), dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            log.error("memory tier: cannot read the copy of rank %d for sending: %s", to, exc)
            collectives.send(torch.tensor([-1, 0], dtype=torch.int64), to, self.group, tag=_TAG_HEADER)
            return
        collectives.send(torch.tensor([copy["size"], meta.numel()], dtype=torch.int64), to, self.group,
                         tag=_TAG_HEADER)
        collectives.send(meta, to, self.group, tag=_TAG_INFO)
        collectives.send(data, to, self.group, tag=_TAG_DATA)

    def receive_copy(self, holder: int):
        """(bytes, its manifest, problem) of this rank's copy streamed from ``holder``."""
        header = torch.empty(2, dtype=torch.int64)
        collectives.recv(header, holder, self.group, tag=_TAG_HEADER)
        size, meta_len = int(header[0]), int(header[1])
        if size < 0:
            return None, None, f"rank {self.rank}: the peer rank {holder} could not read its replica"
        meta = torch.empty(meta_len, dtype=torch.uint8)
        collectives.recv(meta, holder, self.group, tag=_TAG_INFO)
        buf = torch.empty(size, dtype=torch.uint8)
        collectives.recv(buf, holder, self.group, tag=_TAG_DATA)
        copy = json.loads(meta.numpy().tobytes())
        if checksum_buffer(buf.numpy(), copy["algorithm"]) != copy["checksum"]:
            return None, None, f"rank {self.rank}: the replica streamed from rank {holder} arrived damaged"
        return buf, copy.get("manifest"), None
