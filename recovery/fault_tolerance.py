"""Replica groups managed by torchft (``parallel.fault_tolerance``): a lost group does not stop the others, a
restarted group takes the live training state from a peer, and every step still trains on exactly the global
batch of the uninterrupted run, in the same order.

Each replica group is its own torchrun job: dp_shard x tp ranks, FSDP2 on the group's own mesh, as without
fault tolerance. Across groups a ``torchft.Manager`` per rank (one Lighthouse per job) agrees a quorum at the
start of every step, sums each rank's gradient shards with the same rank of the other groups in the quorum, and
votes whether the step may be applied. The trainer (trainer/run.py) calls this module at three points; a run
without fault tolerance never imports it (nor torchft):

    ft = ReplicaGroups(cfg, world, state, plan, dp_rank, run_dir)     # after the resume
    step = ft.start_step(data)                                         # the quorum; may heal this group
    result = train_step(..., across_replicas=ft.all_reduce, commit=ft.commit)
    ft.end_step(step, result, data)                                    # a step voted away is read again

The global batch is kept (``preserve_batch``): the quorum says how many groups take part in this step (n) and
which one this group is (i); the global batch is split over n x dp ranks with the arithmetic of an elastic
restart (data/batching.py: more accumulation micro-steps when n is smaller), this group's ranks being dp
ranks i x dp to (i + 1) x dp - 1. Each micro-batch's loss is divided by the global batch's token count
(training/step.py) and the gradients are summed across groups, not averaged, so the gradient is the global
batch's whatever n is. torchft's own default (``preserve_batch=false``) keeps each group's share fixed: a
missing group's samples are skipped.

The quorum is synchronous (``use_async_quorum=False``): with the async quorum torchft reads FSDP2's state dict
from its quorum thread during backward, which crashed here. State moves between groups over the process group
(``PGTransport``), not torchft's HTTP transport, which advertises the host name and listens on every interface.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import time
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from data.batching import BatchPlan, SampleRange, make_batch_plan
from parallel import collectives

log = logging.getLogger("trainer")

LOG_NAME = "fault_tolerance.jsonl"  # one row per step attempt, written by each group's rank 0
QUORUM_ATTEMPTS = 3  # quorums that fail in a row before the group stops (its torchrun restarts it)


def _address(host: str) -> Tuple[int, str]:
    """(family, address) that ``host`` resolves to: where this group listens."""
    family, *_, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    return family, sockaddr[0]


def store_listening_on(host: str) -> "torch.distributed.TCPStore":
    """A TCPStore server on ``host``'s address alone: c10d's server binds every interface whatever host it is
    given, but takes a socket already bound and listening (``master_listen_fd``)."""
    family, address = _address(host)
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return torch.distributed.TCPStore(address, port, is_master=True, wait_for_workers=False,
                                      master_listen_fd=listener.detach())  # the store owns the socket now


def rendezvous_store_on(pg, host: str) -> None:
    """torchft's process group across groups (``pg``) hosts a store its peers rendezvous on at every new quorum:
    torchft 2026.10.26 creates it on first use (``get_reconfigure_handle``) on every interface and advertises
    ``socket.gethostname()``. Here it is created first, on ``host``'s address (``store_listening_on``), and the
    handle advertises ``host``, as the group's manager does."""
    store = pg._rendezvous_store = store_listening_on(host)
    handle = pg.get_reconfigure_handle

    def advertised() -> str:
        fields = json.loads(handle())
        fields["store"] = f"{host}:{store.port}"
        return json.dumps(fields)

    pg.get_reconfigure_handle = advertised


@contextmanager
def manager_server_bound_to(host: str) -> Iterator[None]:
    """While torchft's ``Manager`` is built, its ``ManagerServer`` (the group's quorum and heartbeat server, run
    by the group's rank 0) listens on ``host``'s address instead of every interface. torchft 2026.10.26 hardcodes
    ``bind = f"[::]:{port}"`` in ``Manager.__init__`` and has no setting for it, so this is the one place that
    changes it: ``torchft.manager.ManagerServer`` is swapped for a wrapper that keeps the port and replaces the
    address with the one the group advertises (parallel.fault_tolerance.hostname), then swapped back."""
    import torchft.manager as module

    server = module.ManagerServer
    family, address = _address(host)
    address = f"[{address}]" if family == socket.AF_INET6 else address

    def bound(*args, bind: str, **kwargs):
        return server(*args, bind=f"{address}:{bind.rsplit(':', 1)[1]}", **kwargs)

    module.ManagerServer = bound
    try:
        yield
    finally:
        module.ManagerServer = server


def resharded(model: torch.nn.Module) -> None:
    """FSDP2 modules back to their sharded parameters. After a no-grad forward (the probe that verifies a durable
    resume) FSDP2 keeps a module's gathered copies registered, and loading a peer's state then fails: the
    optimizer's sharded parameters are not the model's (torch's set_state_dict: KeyError on a DTensor)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # a no-op where sharded already


def group_memory_tier(cfg, memory, root: Path):
    """This group's checkpoint.memory: snapshots by replica group 0 only (the durable saves' writer moves with the
    quorum, the tier's schedule is fixed at the launch: group 0 is the writer whenever it is in), in a folder
    of its group's own (root/group_<id>: the groups of one host share a run_name, so they would write the same
    files). Another group's own snapshots could not be trusted on a restart: it may resume one at the very step a
    peer reached by training alone meanwhile (the same step, other bits: the sum over other groups), and torchft,
    seeing equal steps, would heal neither. So a restarted group takes the live state from a peer, and when every
    group was lost, group 0 resumes its snapshot and the others take the state from it, as with durable
    checkpoints. ``root``: the tier's folder on this node without replica groups."""
    own = Path(root) / f"group_{cfg.replica_id}"
    return dataclasses.replace(memory, root=str(own), interval=memory.interval if cfg.replica_id == 0 else "0")


class ManagerState:
    """The torchft manager's own state (its step and its count of committed batches) as a part of the training
    state: the durable checkpoints hold it (whichever group wrote them), and a cold start hands it back to the
    manager. Built before the resume (the manager is made after it); once the manager exists, its live state is
    what a save takes."""

    def __init__(self):
        self.saved: Optional[Dict[str, int]] = None  # from a durable checkpoint
        self.manager = None

    def state_dict(self) -> Dict[str, int]:
        return dict(self.manager.state_dict() if self.manager is not None else self.saved or {})

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if self.manager is None:  # once it exists, a peer's state reaches the manager through torchft itself
            self.saved = {k: int(v) for k, v in state.items()}


class ReplicaGroups:
    """This rank's torchft manager, and the step's split of the global batch."""

    def __init__(self, cfg, world, state, manager_state: ManagerState, plan: BatchPlan, dp_rank: int,
                 run_dir: Path):
        """``cfg``: parallel.fault_tolerance; ``state``: the TrainingState (what a rejoining group receives), whose
        ``manager_state`` (its ``torchft`` part) the durable resume filled; ``plan`` and ``dp_rank``: this group's
        own batch plan and this rank's place in it."""
        try:
            from torchft import Manager
            from torchft.checkpointing.pg_transport import PGTransport
            from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        except ImportError as exc:
            raise ImportError(f"parallel.fault_tolerance.enabled=true needs torchft ({exc}): install the project "
                              "with its ft extra (pip install -e '.[ft]')") from exc

        self.cfg, self.state, self.world, self.run_dir = cfg, state, world, run_dir
        self.group_plan, self.group_dp_rank = plan, dp_rank
        self.log_path = Path(run_dir) / LOG_NAME if world.is_main else None
        timeout = timedelta(seconds=cfg.timeout_s)
        self._store = None
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:  # torchrun's store
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # a group of one process started without torchrun: a store of its own, on loopback
            self._store = store_listening_on("127.0.0.1")
            addr, port = "127.0.0.1", self._store.port
        host = cfg.hostname or socket.gethostname()  # what the group advertises
        self.pg = ProcessGroupNCCL(timeout) if world.device.type == "cuda" else ProcessGroupGloo(timeout)
        if cfg.hostname:  # and where it listens; unset: torchft's own binds, every interface (the host's name
            rendezvous_store_on(self.pg, host)  # may resolve to a loopback address locally, e.g. 127.0.1.1)
        transport = PGTransport(self.pg, timeout=timeout, device=world.device)
        receive = transport.recv_checkpoint

        def timed_receive(*args, **kwargs):
            start = time.perf_counter()
            try:
                return receive(*args, **kwargs)
            finally:
                self.transfer_s = time.perf_counter() - start

        transport.recv_checkpoint = timed_receive  # the weight transfer's own time, for the log
        with manager_server_bound_to(host) if cfg.hostname else nullcontext():  # not torchft's [::]
            self.manager = Manager(
                pg=self.pg, load_state_dict=self._load, state_dict=self._state_dict,
                min_replica_size=cfg.min_replicas, use_async_quorum=False, timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s), connect_timeout=timeout,
                rank=world.rank, world_size=world.world_size, store_addr=addr, store_port=port,
                lighthouse_addr=cfg.lighthouse, replica_id=f"group_{cfg.replica_id}",
                hostname=host, checkpoint_transport=transport,
                init_sync=False)  # every group initialises the same weights from the seed
        saved = manager_state.saved or {}
        if saved.get("step") != state.step:  # none saved (a checkpoint without fault tolerance, or none)
            saved = {"step": state.step, "batches_committed": 0}
        self.manager.load_state_dict(saved)
        manager_state.manager = self.manager
        self.participants, self.shares, self.index = 0, 0, 0  # the quorum's groups; the batch's shares; ours
        self.quorum_s = self.transfer_s = self.load_s = 0.0
        self.started = 0.0  # time.time() when the step's quorum was asked for
        self.healed = False
        self.writer = False  # this group saves the step's durable checkpoint (writes_checkpoint)
        self._data_before: dict = {}

    def _state_dict(self) -> dict:
        """This group's training state, sent to a group behind it at the quorum (sharded, as ``_load`` takes it)."""
        resharded(self.state.model)
        return self.state.state_dict()

    def _load(self, state_dict) -> None:
        """A peer's training state (weights, optimizer, schedule, data position, step), received at the quorum."""
        start = time.perf_counter()
        resharded(self.state.model)
        self.state.load_state_dict(state_dict)
        self.load_s, self.healed = time.perf_counter() - start, True

    def start_step(self, data) -> int:
        """The step's quorum (it waits for a lost peer to be declared dead, and heals this group when it is
        behind), then this rank's share of the global batch. Returns the step to run (0-based: steps done)."""
        start, self.started = time.perf_counter(), time.time()
        self.transfer_s = self.load_s = 0.0
        self.healed = False
        for attempt in range(1, QUORUM_ATTEMPTS + 1):  # a quorum that failed (a peer lost during it) is asked again
            self.manager.start_quorum()
            n, index = self.manager.num_participants(), self.manager.participating_rank()
            # asked again by every rank of the group or by none: torchft waits for all of a group's ranks at each
            # quorum, and a peer lost while the quorum reconfigures the process group can fail one rank's part alone
            if not collectives.any_rank(index is None or bool(self.manager.errored())):
                break
            why = self.manager.errored() or ("not in the quorum" if index is None else "on another rank of this group")
            log.warning("replica group %d: quorum attempt %d of %d failed: %s", self.cfg.replica_id, attempt,
                        QUORUM_ATTEMPTS, why)
        else:
            raise RuntimeError(f"replica group {self.cfg.replica_id}: {QUORUM_ATTEMPTS} quorums failed in a row (the "
                               f"last: {why}); is the Lighthouse at {self.cfg.lighthouse} up?")
        self.quorum_s = time.perf_counter() - start
        if self.manager.current_step() != self.state.step:
            raise RuntimeError(f"replica group {self.cfg.replica_id}: torchft is at step "
                               f"{self.manager.current_step()} but the training state at step {self.state.step}")
        dp = self.group_plan.dp_size
        G, micro = self.group_plan.global_batch_size, self.group_plan.micro_batch_size
        self.participants, self.writer = n, index == 0
        if not self.cfg.preserve_batch:  # torchft's own semantics: a fixed share per group
            n, index = self.cfg.groups, self.cfg.replica_id
        self.shares, self.index = n, index
        data.set_split(make_batch_plan(G, micro, n * dp), index * dp + self.group_dp_rank)
        self._data_before = data.state_dict()
        return self.state.step

    def writes_checkpoint(self) -> bool:
        """Whether this group saves this step's durable checkpoint: the groups share checkpoint.dir and the step's
        quorum names one writer, its first participant (torchft orders them by replica id: group 0 while it is
        in the quorum, else the lowest id that is). Every group reads the same quorum, so at each step exactly one
        writes; the writer changes only between steps, and a save still in flight from the previous writer is a
        step of its own (its own folder). Every rank of a group reads the same quorum: the group agrees."""
        return self.writer

    def all_reduce(self, tensors: List[torch.Tensor]) -> None:
        """Sum this rank's loss and gradient shards over the groups of the quorum (training/step.py)."""
        collectives.all_reduce_across_replicas(tensors, self.manager)

    def commit(self) -> bool:
        """This group applies the step only when each of its ranks summed it with every group of the quorum; a
        group that lost a peer during the all-reduce runs the step again, and a group left behind so takes its
        peers' state at the next quorum."""
        return self.manager.should_commit()

    def end_step(self, step: int, result, data) -> None:
        """Log the attempt of 0-based ``step``; one voted away is read again at the next quorum."""
        if self.log_path is not None:
            per_group = self.group_plan.global_batch_size // self.shares
            first = int(self._data_before["samples_consumed"]) + self.index * per_group
            row = {"step": step + 1, "committed": result.committed, "participants": self.participants,
                   "index": self.index, "samples": [first, per_group],
                   "tokens": data.dataset.target_count(SampleRange(first, per_group)),
                   "global_tokens": data.global_target_tokens, "batches_committed": self.manager.batches_committed(),
                   "loss": result.loss, "healed": self.healed, "quorum_s": round(self.quorum_s, 4),
                   "transfer_s": round(self.transfer_s, 4), "load_s": round(self.load_s, 4),
                   "step_s": round(result.seconds, 4), "started": self.started, "time": time.time()}
            with open(self.log_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if not result.committed:
            log.warning("replica group %d: step %d voted away (a peer was lost); it is read again",
                        self.cfg.replica_id, step + 1)
            data.load_state_dict(self._data_before)

    def rolled_back(self, step: int, loaded: bool) -> None:
        """After a rollback to ``step`` agreed across the groups (recovery/guards/across_groups.py): torchft's step
        is the training state's again where this group loaded it (start_step checks they match), or one below where
        it did not, so that the next quorum heals it from a group that did (torchft heals a group behind)."""
        self.manager.load_state_dict({"step": step if loaded else step - 1,
                                      "batches_committed": self.manager.batches_committed()})

    def finish(self, model: torch.nn.Module) -> None:
        """The end of the run: a digest of this rank's weights in the log (every group's must be the same)."""
        digest = hashlib.sha256()
        for name, tensor in model.state_dict().items():
            local = getattr(tensor, "_local_tensor", tensor).detach().cpu().contiguous().reshape(-1)
            digest.update(name.encode() + local.view(torch.uint8).numpy().tobytes())
        row = {"final": True, "step": self.state.step, "rank": self.world.rank, "weights_sha256": digest.hexdigest()}
        with open(Path(self.run_dir) / f"weights-rank{self.world.rank}.json", "w") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.manager.shutdown(wait=False)
