"""The memory tier (checkpoint/memory/tier.py): node-local snapshots with a peer replica.

The distributed tests run two torchrun agents on this machine, one worker each, as two nodes
(``checkpoint.memory.node`` gives each its own directory under the memory root), with the
default config (guards on) at a memory interval of 2 and a durable interval of 20, and
compare every logged loss bitwise with an uninterrupted run.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from checkpoint.config import AUTO_MEASURE_STEPS
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.snapshot import SnapshotError, apply_snapshot, write_snapshot
from checkpoint.memory.tier import MemoryTier
from checkpoint.state.training_state import TrainingState
from metrics.records import read_metrics, step_losses
from recovery.interval import choose_interval_steps
from rehearsal.chains import faults_override
from rehearsal.processes import free_port
from rehearsal.runs import tiny_overrides
from support.launch import RDZV_KEEP_ALIVE, run_train
from support.processes import start, stop
from support.tmpfs import tmpfs

STEPS, MEMORY_INTERVAL, DURABLE_INTERVAL = 32, 2, 20
KILL_STEP = random.Random(16).choice(range(23, 30, 2))  # after the durable save of step 20; odd: just after a snapshot
# Each attempt's workers get a store of their own (needed for replacement nodes); agents log at INFO.
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}


def overrides(run_dir: Path, data: Path, memory_root: Path, extra=()):
    return tiny_overrides(run_dir, data, STEPS, DURABLE_INTERVAL, extra=[
        f"checkpoint.memory.interval={MEMORY_INTERVAL}", f"checkpoint.memory.root={memory_root}", *extra])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, pydoc_data):
    """The uninterrupted run at world 2 (the memory tier on: snapshots change nothing)."""
    tmp = tmp_path_factory.mktemp("memtier-baseline")
    run_train(overrides(tmp / "run", pydoc_data, tmp / "shm"), nproc=2)
    return step_losses(tmp / "run")


class Nodes:
    """Two torchrun agents on this host as two nodes (c10d rendezvous, ``per_node`` workers each)."""

    def __init__(self, tmp: Path, args, max_restarts: int = 3, per_node: int = 1):
        self.tmp, self.args, self.max_restarts, self.per_node = tmp, list(args), max_restarts, per_node
        self.port = free_port()
        self.agents: dict = {}
        self.logs: dict = {}
        self.launches = 0

    def start(self, node: int) -> subprocess.Popen:
        self.launches += 1
        log_path = self.tmp / f"node{node}-{self.launches}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={self.per_node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=memtier",
               # one host plays both nodes: only node 0 may host the rendezvous store
               f"--rdzv-conf=is_host={'true' if node == 0 else 'false'},{RDZV_KEEP_ALIVE}",
               f"--max-restarts={self.max_restarts}", "--monitor-interval=0.5", "train.py", *self.args,
               f"checkpoint.memory.node={node}"]
        with open(log_path, "w") as log:
            self.agents[node] = start(cmd, log, extra_env=ENV, start_new_session=True)
        self.logs[node] = log_path
        if node == 0:
            time.sleep(1.0)  # node 0 hosts the rendezvous store
        return self.agents[node]

    def wait(self, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        codes = {}
        for node, agent in self.agents.items():
            codes[node] = agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        return codes

    def run_both(self) -> dict:
        """Start both nodes and wait for both agents to end; their exit codes."""
        try:
            self.start(0)
            self.start(1)
            return self.wait()
        finally:
            self.stop()

    def text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-5000:]}" for p in sorted(self.tmp.glob("node*.log")))

    def stop(self) -> None:
        for agent in self.agents.values():
            stop(agent)


def _resume_events(run_dir: Path) -> list:
    return read_metrics(run_dir, "resume")


def _assert_bitwise(run_dir: Path, baseline: dict) -> None:
    got = step_losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    diverged = [s for s in got if got[s] != baseline[s]]
    assert not diverged, [(s, got[s], baseline[s]) for s in diverged[:5]]


# -- in one process ----------------------------------------------------------------------------
def _tiny_state(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
        sched.step()
    state = TrainingState(model, opt, sched)
    state.step, state.tokens, state.samples = 3, 120, 15
    return state


def _flat(state: TrainingState) -> dict:
    from checkpoint.memory.snapshot import state_leaves

    return {p: (v.clone() if isinstance(v, torch.Tensor) else v) for p, v in state_leaves(state.state_dict())
            if p[0] not in ("rng", "meta")}


def test_a_snapshot_restores_every_leaf_bitwise_and_refuses_another_model(tmp_path):
    saved = _tiny_state(0)
    expect = _flat(saved)
    path = tmp_path / "rank00000.snap"
    size, checksum = write_snapshot(path, saved.state_dict(), "crc32")
    assert size == path.stat().st_size and checksum
    other = _tiny_state(1)  # other weights, other moments, other counters
    apply_snapshot(other, torch.from_file(str(path), size=size, dtype=torch.uint8))
    got = _flat(other)
    assert set(got) == set(expect)
    for k, v in expect.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    assert (other.step, other.tokens, other.samples) == (3, 120, 15)

    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    wider = TrainingState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    with pytest.raises(SnapshotError, match=r"0\.weight: snapshot float32\[16, 8\], this run float32\[32, 8\]"):
        apply_snapshot(wider, torch.from_file(str(path), size=size, dtype=torch.uint8))
    damaged = bytearray(path.read_bytes())
    damaged[:8] = b"XXXXXXXX"
    with pytest.raises(SnapshotError, match="not a snapshot"):
        apply_snapshot(_tiny_state(0), torch.frombuffer(damaged, dtype=torch.uint8))


@pytest.mark.parametrize("spare_bytes", [0, 100, 10**6], ids=["none", "shorter", "longer"])
def test_a_copy_written_over_a_spare_file_holds_exactly_its_bytes_and_their_checksum(tmp_path, spare_bytes):
    """The next copy is written over a dropped copy's file (MemoryTier.spare), by writes and, for a
    replica, received straight into its mapped pages: the file must end up holding exactly the new
    bytes (nothing of the old file after them, which a restore's read would not see but tmpfs would
    hold), and the checksum must be that of the file as stored."""
    from checkpoint.durable.manifest import hasher
    from checkpoint.memory.snapshot import HashedWriter

    saved = _tiny_state(0)
    staged_path, spare = tmp_path / "staged.snap", tmp_path / "spare" / "rank00000-own.snap"
    size, checksum = write_snapshot(staged_path, saved.state_dict(), "xxh3_64")
    data = staged_path.read_bytes()
    spare.parent.mkdir()

    def file_checksum(path):
        h = hasher("xxh3_64")
        h.update(path.read_bytes())
        return h.hexdigest()

    for how in ("written", "received"):
        if spare_bytes:
            spare.write_bytes(b"\xff" * (spare_bytes if spare_bytes > 100 else size - 100))
        path = tmp_path / f"{how}.snap"
        writer = HashedWriter(path, "xxh3_64", reuse=spare)
        head = 4096
        writer.write(memoryview(data)[:head])
        into = writer.mapped(size) if how == "received" else None
        assert (into is not None) == (how == "received" and bool(spare_bytes))  # only a spare's pages
        if into is None:
            writer.write(memoryview(data)[head:])
        else:  # as gloo would: the bytes land in the mapping, then are hashed there
            into[head:].copy_(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8))
            writer.hashed(into[head:])
            del into
        assert writer.finish() == (size, checksum), how
        assert path.read_bytes() == data and not spare.exists(), how
        assert file_checksum(path) == checksum, how


def _probed_run(tmp_path, durable_interval: int = 0):
    """A world-1 run's pieces in this process: the debug model, its optimizer and schedule, a probe
    that counts its forwards, a checkpoint manager whose memory tier snapshots every 2 steps (the
    durable tier every ``durable_interval`` steps, off by default)."""
    from model.llama import build_model
    from parallel.dims import ParallelDims
    from recovery.probe import PROBE_SEQUENCES, Probe
    from support.config import compose_debug
    from trainer.config import typed
    from trainer.run import checkpoint_manager
    from training.optimizer import build_optimizer
    from training.schedule import build_scheduler

    cfg = compose_debug(f"output_root={tmp_path}", "run_name=probe-count", f"checkpoint.interval={durable_interval}",
                        "recovery.guards.shadow_interval=2", "checkpoint.memory.interval=2",
                        f"checkpoint.memory.root={tmp_path / 'shm'}", "checkpoint.memory.replicas=0")
    model = build_model(OmegaConf.to_object(cfg.model), seed=0)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.training.steps)
    state = TrainingState(model, optimizer, scheduler, optim_config=cfg.optim)
    rows = torch.randint(0, 256, (PROBE_SEQUENCES, 17), generator=torch.Generator().manual_seed(1))
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    probe = Probe(model, (rows[:, :-1], rows[:, 1:]), torch.device("cpu"),
                  weights_version=lambda: state.weights_version)
    ckpt = checkpoint_manager(typed(cfg)[0], state, 0, 1, ParallelDims(1, 1, 1, 1).layout, torch.device("cpu"),
                              probe=probe)

    def train_step():
        model(rows[:, :-1]).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state.record_step(16 * PROBE_SEQUENCES, PROBE_SEQUENCES)
        forwards.clear()  # the training forward is not the probe's

    return cfg, state, probe, forwards, ckpt, train_step


def _swap_moments(state):
    """Exchange the two AdamW moments of the first parameter (same shape: a leaf in the wrong place)."""
    moments = next(iter(state.optimizer.state.values()))
    with torch.no_grad():
        held = moments["exp_avg"].clone()
        moments["exp_avg"].copy_(moments["exp_avg_sq"])
        moments["exp_avg_sq"].copy_(held)


def _damage_weight(state):
    with torch.no_grad():
        next(state.model.parameters()).view(-1)[0] += 1.0


@pytest.mark.parametrize("after_apply", [_swap_moments, _damage_weight], ids=["swapped", "damaged"])
def test_a_snapshot_runs_no_probe_and_its_restore_checks_every_applied_byte(tmp_path, after_apply):
    """A memory snapshot's manifest carries no probe loss and computes none; its restore compares
    every tensor the state holds after the apply with the snapshot's bytes, and that check, not a
    forward, is what post-load verification relies on. A leaf put in the wrong place or damaged
    after the apply is refused, and the snapshot is forgotten."""
    from checkpoint.durable.manifest import APPLIED_BYTES, CheckpointError
    from recovery.resume import resume
    from recovery.verify import ResumeVerifier

    cfg, state, probe, forwards, ckpt, train_step = _probed_run(tmp_path)
    try:
        train_step()
        train_step()
        ckpt.after_step(2, 5.0)  # the memory tier is due
        ckpt.memory.wait()
        [record] = ckpt.memory.finished()
        assert record.committed and forwards == []  # no probe forward in the snapshot
        saved = _flat(state)
        train_step()  # the live state moves on
        verifier = ResumeVerifier(cfg.recovery, cfg.optim, cfg.training.steps, ckpt, state, probe, ckpt.layout, 1)
        assert resume(ckpt, verifier).startswith("from the memory tier (step 2")
        assert forwards == [] and verifier.report["problems"] == []  # nor in its verification
        assert verifier.report["probe_loss"] is None
        got = _flat(state)
        for k, v in saved.items():
            assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
        snap = json.loads(next((tmp_path / "shm").glob("step_*/rank00000.json")).read_text())["manifest"]
        assert snap["probe_loss"] is None and snap["probe_method"] == APPLIED_BYTES

        train_step()
        load = state.load_state_dict
        state.load_state_dict = lambda sd: (load(sd), after_apply(state))
        with pytest.raises(CheckpointError, match="differ from the snapshot's bytes") as failed:
            resume(ckpt, verifier)
        name = "optim.state.tok_embeddings.weight.exp_avg" if after_apply is _swap_moments \
            else "model.tok_embeddings.weight"
        assert name in str(failed.value)
        assert forwards == [] and not list((tmp_path / "shm").glob("step_*"))  # refused and forgotten
    finally:
        ckpt.close()


def test_a_step_where_a_save_a_snapshot_and_the_shadow_check_fall_due_runs_the_probe_once(tmp_path):
    """In the loop's order: the guards' shadow check after the update, then the durable save and
    the memory snapshot of the same step: one probe forward for all (the snapshot runs none), and
    the durable manifest holds the value the shadow check saw."""
    from checkpoint.durable.manifest import read_manifest
    from recovery.guards.guard import TrainingGuards
    from recovery.probe import PROBE_METHOD, PROBE_SEQUENCES
    from trainer.preflight import claim_lease

    cfg, state, probe, forwards, ckpt, train_step = _probed_run(tmp_path, durable_interval=2)
    seen = []
    guards = TrainingGuards(cfg.recovery.guards, state.model, torch.device("cpu"), tmp_path / "run", 0,
                            shadow_loss=lambda: seen.append(probe()) or seen[-1])
    try:
        ckpt.preflight(claim_lease(cfg.checkpoint))  # as trainer/run.py: the lease first
        train_step()
        train_step()
        assert ckpt.due(2) and ckpt.memory.due(2) and cfg.recovery.guards.shadow_interval == 2
        guards.after_update(2)  # the shadow check
        ckpt.after_step(2, 5.0)  # the durable save and the snapshot
        ckpt.wait()
        ckpt.memory.wait()
        assert len(seen) == 1 and len(forwards) == PROBE_SEQUENCES  # one probe, one sequence at a time
        manifest = read_manifest(ckpt.root / "step_00000002")
        assert manifest.probe_loss == seen[0] and manifest.probe_method == PROBE_METHOD
    finally:
        ckpt.close()


def test_the_snapshot_buffer_pins_the_states_bytes_once(monkeypatch):
    """The tier's one flat buffer is pinned by registering its pages, not by CUDA's caching host allocator
    (which would round it up to the next power of two: up to 2x the state, never given back). CPU: the
    registration is recorded, not made; a GPU is not verified here."""
    from checkpoint.durable import staging
    from checkpoint.memory.snapshot import FlatStager

    registered = []
    monkeypatch.setattr(staging, "_register", lambda buf: registered.append(buf.numel()))  # CUDA: cudaHostRegister
    sd = {"w": torch.randn(300, 7), "h": torch.randn(5).to(torch.bfloat16), "step": torch.tensor(2.0)}
    state_bytes = sum(t.numel() * t.element_size() for t in sd.values())  # 8414: a power-of-two pin is 16384
    stager = FlatStager(pin_memory=True)
    staged = stager.stage(sd)
    stager.stage(sd)  # reused
    assert registered == [state_bytes] == [staged.region.numel()]


def test_preflight_names_the_sizes_and_the_fixes(tmp_path):
    cfg = OmegaConf.structured(MemoryTierConfig(interval="2", replicas=1, root=str(tmp_path / "shm")))
    tier = MemoryTier(cfg, run_name="r", rank=0, world_size=4, local_world_size=2, layout={"dp_shard": 4},
                      config_hash="h", algorithm="crc32")
    try:
        assert tier.preflight(1 << 20) is None
        problem = tier.preflight(1 << 50)  # a PiB per rank fits nowhere
        assert "needs 8192.00 TiB" not in problem  # GiB throughout
        assert "2 ranks on this node x 1048576.00 GiB of state x 2 copies (own + replica) x 2" in problem
        for fix in ("--shm-size", "remount,size=", "checkpoint.memory.root", "checkpoint.memory.required=false"):
            assert fix in problem
    finally:
        tier.close()


def test_preflight_counts_async_process_staging_in_the_same_tmpfs(tmp_path, monkeypatch):
    """async_process stages in /dev/shm, the tier's default root: sharing one tmpfs, the tier's check counts both
    (each alone fits a 4 MiB tmpfs here, together they do not); staging elsewhere is not counted."""
    from checkpoint.durable import preflight

    cfg = OmegaConf.structured(MemoryTierConfig(interval="2", replicas=0, root=str(tmp_path / "shm")))
    tier = MemoryTier(cfg, run_name="r", rank=0, world_size=1, local_world_size=1, layout={"dp_shard": 1},
                      config_hash="h", algorithm="crc32")
    try:
        with tmpfs(tmp_path / "shm", 4) as shm:
            monkeypatch.setattr(preflight, "SHM", shm)
            assert tier.preflight(1 << 20) is None and tier.preflight(0, shared_staging_bytes=3 << 20) is None
            problem = tier.preflight(1 << 20, shared_staging_bytes=3 << 20)
            assert "(1 rank on this node x 1.00 MiB of state x 1 copy (own) x 2 (newest + being written)) + 3.00 " \
                   "MiB of checkpoint.async_mode=async_process staging in the same file system" in problem
            monkeypatch.setattr(preflight, "SHM", tmp_path)  # another file system
            assert tier.preflight(1 << 20, shared_staging_bytes=3 << 20) is None
    finally:
        tier.close()


# -- two nodes -------------------------------------------------------------------------------
@pytest.mark.distributed
def test_a_lost_node_restores_from_its_peers_replica_without_reading_storage(tmp_path, pydoc_data, baseline):
    """Node 1 goes down at KILL_STEP (its agent and worker SIGKILLed), its memory is deleted, a
    replacement agent joins: the job re-forms at world 2, node 1's rank gets its state from node 0's
    replica, node 0's from its own memory. The durable checkpoints are moved away before the job can
    re-form, so there is nothing on storage to read."""
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    fault = faults_override([{"kind": "node_loss", "phase": "data_wait", "step": KILL_STEP, "rank": 1}])
    nodes = Nodes(tmp_path, overrides(run_dir, pydoc_data, shm, [fault]))
    try:
        nodes.start(0)
        first = nodes.start(1)
        assert first.wait(timeout=600) != 0, nodes.text()  # the node went down
        shutil.rmtree(shm / "node-1")  # its memory with it
        durable = run_dir / "checkpoints"
        moved = tmp_path / "durable-moved-away"
        shutil.move(str(durable), str(moved))
        assert [p.name for p in moved.glob("step_*")] == ["step_00000020"]
        nodes.start(1)  # the replacement
        codes = nodes.wait()
    finally:
        nodes.stop()
    assert codes == {0: 0, 1: 0}, nodes.text()
    last_logged = KILL_STEP - 1
    resume = _resume_events(run_dir)[-1]
    assert resume["source"] == "memory", resume
    assert sorted(resume["sources"].values()) == ["local", "peer"], resume
    assert last_logged - resume["step"] <= 2, (last_logged, resume["step"])  # lost work: at most 2 steps
    assert resume["step"] > DURABLE_INTERVAL
    _assert_bitwise(run_dir, baseline)
    assert "rank 0 local, rank 1 peer" in nodes.text() or "rank 0 peer, rank 1 local" in nodes.text()


@pytest.mark.distributed
def test_a_worker_crash_restores_every_rank_from_its_own_node(tmp_path, pydoc_data, baseline):
    """Rank 1 dies inside the snapshot after KILL_STEP, once its previous snapshot (KILL_STEP - 1) is
    complete on both nodes (a snapshot first waits for the one before): both restore that one from
    their own node's memory. (Killed between snapshots instead, rank 1's own copy of the newest one
    may still be in flight, and the peer's replica is the right source: a test of timing.)"""
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    fault = faults_override([{"kind": "sigkill", "phase": "memory_snapshot", "step": KILL_STEP + 1, "rank": 1}])
    nodes = Nodes(tmp_path, overrides(run_dir, pydoc_data, shm, [fault]))
    codes = nodes.run_both()
    assert codes == {0: 0, 1: 0}, nodes.text()
    resume = _resume_events(run_dir)[-1]
    assert resume["source"] == "memory" and resume["sources"] == {"0": "local", "1": "local"}, resume
    assert resume["step"] == KILL_STEP - 1
    _assert_bitwise(run_dir, baseline)
    assert not list(shm.glob("node-*/step_*")), "a finished run leaves its snapshots in memory"
    assert not list(shm.rglob("*.snap")), "a finished run leaves files in memory"  # the spares too


def _stopped_run(tmp_path: Path, pydoc_data: Path, shm: Path, per_node: int = 1) -> Path:
    """A run that dies in the snapshot after KILL_STEP (rank 0 SIGKILLed inside it, no restarts), once
    the one before (KILL_STEP - 1) is complete on both nodes: a snapshot first waits for the previous
    one. Its snapshots stay in memory. (Killed between snapshots instead, the previous one's replica
    exchange could still be running, and which copies are complete would be a matter of timing.)"""
    run_dir = tmp_path / "run"
    fault = faults_override([{"kind": "sigkill", "phase": "memory_snapshot", "step": KILL_STEP + 1, "rank": 0}])
    nodes = Nodes(tmp_path, overrides(run_dir, pydoc_data, shm, [fault, *_batch(per_node)]), max_restarts=0,
                  per_node=per_node)
    codes = nodes.run_both()
    assert codes[0] != 0, nodes.text()
    return run_dir


def _batch(per_node: int) -> list:
    """The global batch of two nodes of ``per_node`` ranks (one micro batch per rank)."""
    return [] if per_node == 1 else [f"training.global_batch_size={4 * per_node}"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, pydoc_data):
    """One stopped run (its run directory and memory root) that each test below gets a copy of."""
    tmp = tmp_path_factory.mktemp("memtier-stopped")
    return _stopped_run(tmp, pydoc_data, tmp / "shm"), tmp / "shm"


def _copy_of(stopped, tmp_path: Path):
    run_dir, shm = stopped
    shutil.copytree(run_dir, tmp_path / "run")
    shutil.copytree(shm, tmp_path / "shm")
    return tmp_path / "run", tmp_path / "shm"


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _newest_complete(node_dir: Path) -> Path:
    """The newest step directory holding rank 1's committed copy (the one after it may be incomplete)."""
    return max(p.parent for p in node_dir.glob("step_*/rank00001.json"))


@pytest.mark.distributed
@pytest.mark.parametrize("damaged", ["own copy", "both copies"])
def test_a_damaged_copy_falls_back_to_the_peer_and_two_to_the_durable_tier(tmp_path, pydoc_data, baseline,
                                                                           stopped, damaged):
    run_dir, shm = _copy_of(stopped, tmp_path)
    own = _newest_complete(shm / "node-1") / "rank00001.snap"
    replica = _newest_complete(shm / "node-0") / "rank00001.snap"
    assert own.parent.name == replica.parent.name
    snapshot_step = int(own.parent.name.split("_")[1])
    assert snapshot_step == KILL_STEP - 1
    _flip_middle_byte(own)
    if damaged == "both copies":
        _flip_middle_byte(replica)
    restart = Nodes(tmp_path / "restart", overrides(run_dir, pydoc_data, shm))
    restart.tmp.mkdir()
    codes = restart.run_both()
    assert codes == {0: 0, 1: 0}, restart.text()
    resume = _resume_events(run_dir)[-1]
    if damaged == "own copy":
        assert resume["source"] == "memory" and resume["step"] == snapshot_step, resume
        assert resume["sources"] == {"0": "local", "1": "peer"}, resume
        assert "fails its checksum" in restart.text()
    else:
        assert resume["source"] == "storage" and resume["step"] == DURABLE_INTERVAL, resume
        assert "the copy held by rank 0 is unreadable or damaged" in restart.text()  # checked before sending
        assert "failed to load or verify" in restart.text()
    _assert_bitwise(run_dir, baseline)


@pytest.mark.distributed
def test_with_two_ranks_per_node_a_damaged_own_copy_streams_the_next_nodes_replica(tmp_path, pydoc_data):
    """Two nodes of two ranks; rank 1's own copy of the newest complete snapshot (on node 0) has a
    byte flipped. Rank 0 lists the same damaged file (one directory per node); the intact replica
    is on node 1. Rank 1 must get node 1's replica, and the run resume from that snapshot and
    replay its steps bitwise, not fall back to the durable tier."""
    shm = tmp_path / "shm"
    run_dir = _stopped_run(tmp_path, pydoc_data, shm, per_node=2)
    own = _newest_complete(shm / "node-0") / "rank00001.snap"
    assert (_newest_complete(shm / "node-1") / "rank00001.snap").exists()  # the replica, same step
    assert _newest_complete(shm / "node-1").name == own.parent.name
    snapshot_step = int(own.parent.name.split("_")[1])
    assert snapshot_step == KILL_STEP - 1
    _flip_middle_byte(own)
    before = step_losses(run_dir)
    restart = Nodes(tmp_path / "restart", overrides(run_dir, pydoc_data, shm, _batch(2)), per_node=2)
    restart.tmp.mkdir()
    codes = restart.run_both()
    assert codes == {0: 0, 1: 0}, restart.text()
    resume = _resume_events(run_dir)[-1]
    assert resume["source"] == "memory" and resume["step"] == snapshot_step, (resume, restart.text()[-6000:])
    assert resume["sources"] == {"0": "local", "1": "peer", "2": "local", "3": "local"}, resume
    assert "fails its checksum" in restart.text()
    after = step_losses(run_dir)
    assert sorted(after) == list(range(1, STEPS + 1))
    replayed = [s for s in before if s > snapshot_step]
    assert replayed and [after[s] for s in replayed] == [before[s] for s in replayed], (replayed, before, after)


@pytest.mark.distributed
def test_a_changed_world_size_ignores_the_memory_tier_and_says_so(tmp_path, pydoc_data, stopped):
    run_dir, shm = _copy_of(stopped, tmp_path)
    assert list(shm.glob("node-*/step_*"))
    proc = run_train(overrides(run_dir, pydoc_data, shm, ["checkpoint.memory.node=0"]), nproc=1)
    assert "the snapshots in memory were taken at world 2" in proc.stderr
    assert "resuming from the durable tier" in proc.stderr
    resume = _resume_events(run_dir)[-1]
    assert resume["source"] == "storage" and resume["step"] == DURABLE_INTERVAL, resume


@pytest.mark.distributed
def test_auto_interval_is_chosen_from_the_measured_snapshot_cost(tmp_path, pydoc_data):
    run_dir = tmp_path / "run"
    run_train(tiny_overrides(run_dir, pydoc_data, 14, 0, extra=[
        "checkpoint.memory.interval=auto", f"checkpoint.memory.root={tmp_path / 'shm'}"]))
    chosen = [e for e in read_metrics(run_dir, "checkpoint_interval") if e.get("tier") == "memory"]
    # Chosen once, at the first step end after the first snapshot's record arrived: at once on an idle
    # machine, a step or two later on a loaded one (the snapshot's background part is still running).
    assert len(chosen) == 1 and AUTO_MEASURE_STEPS <= chosen[0]["step"] < 14, chosen
    every, chosen_at = chosen[0]["interval_steps"], chosen[0]["step"]
    snapshots = [e["step"] for e in read_metrics(run_dir, "memory_snapshot") if e["committed"]]
    # Every AUTO_MEASURE_STEPS steps until then; the chosen interval from the next step on.
    expected = [s for s in range(1, 15) if s % (AUTO_MEASURE_STEPS if s <= chosen_at else every) == 0]
    assert snapshots[0] == AUTO_MEASURE_STEPS and snapshots == expected, (chosen_at, every, snapshots)
    assert chosen[0]["blocking_s"] > 0 and chosen[0]["mtbf_s"] > 0


@pytest.mark.distributed
def test_auto_memory_interval_is_the_same_on_both_nodes_when_one_is_slower(tmp_path, pydoc_data):
    """checkpoint.memory.interval=auto on two nodes of two ranks. The last worker is slower at
    every step and its host copy stalls training 0.6 s longer (the memory_snapshot fault): alone, it
    would choose another interval than the others and enter the replica exchange at other steps.
    All must snapshot at the same steps, every snapshot complete on both nodes, and the run must finish."""
    run_dir, steps, per_node = tmp_path / "run", 24, 2
    last = 2 * per_node - 1
    faults = faults_override([
        {"kind": "slow", "phase": "step", "step": -1, "rank": last, "delay_s": 0.03},
        {"kind": "slow", "phase": "memory_snapshot", "step": -1, "rank": last, "delay_s": 0.6}])
    args = overrides(run_dir, pydoc_data, tmp_path / "shm", [
        "checkpoint.memory.interval=auto", f"training.steps={steps}", "checkpoint.interval=0",
        f"training.global_batch_size={4 * per_node}", "recovery.device_mtbf_hours=0.0001", faults])
    nodes = Nodes(tmp_path, args, max_restarts=0, per_node=per_node)
    codes = nodes.run_both()
    assert codes == {0: 0, 1: 0}, nodes.text()[-6000:]
    [ev] = [e for e in read_metrics(run_dir, "checkpoint_interval") if e["tier"] == "memory"]
    assert ev["blocking_s"] >= 0.6, ev  # node 1's stall, agreed: node 0's own is milliseconds
    again = choose_interval_steps(ev["step_s"], ev["blocking_s"], ev["write_s"], ev["mtbf_s"], max_steps=steps)
    assert ev["interval_steps"] == again.steps > 1, ev
    snapshots = read_metrics(run_dir, "memory_snapshot")
    expected = list(range(AUTO_MEASURE_STEPS, ev["step"] + 1, AUTO_MEASURE_STEPS)) + \
        [s for s in range(ev["step"] + 1, steps + 1) if s % again.steps == 0]
    assert [e["step"] for e in snapshots] == expected, (snapshots, ev)
    assert all(e["committed"] for e in snapshots), snapshots  # both nodes hold both copies of each


@pytest.mark.distributed
def test_shared_memory_filling_up_mid_run_skips_snapshots_and_training_goes_on(tmp_path, pydoc_data, baseline):
    """Pre-flight passed; then something else fills the tmpfs while both ranks stall at step 3, after
    the first snapshot (before any step is dropped, so the tier holds no spare files to write over):
    the snapshots fail on every rank together (no rank waits for a transfer that will not come),
    training goes on bitwise, and once there is room again snapshots complete again."""
    run_dir = tmp_path / "run"
    stall = faults_override([{"kind": "hang", "phase": "step", "step": 3, "rank": -1, "hang_s": 3.0}])
    with tmpfs(tmp_path / "shm", 32) as shm:  # both nodes: 2 x (own + replica) x 2 steps x ~2.7 MB
        nodes = Nodes(tmp_path, overrides(run_dir, pydoc_data, shm, [stall]))
        filler = shm / "filler"
        try:
            nodes.start(0)
            nodes.start(1)
            deadline = time.monotonic() + 300
            while len(list((run_dir / "faults").glob("fired-*"))) < 2:
                assert time.monotonic() < deadline and all(a.poll() is None for a in nodes.agents.values()), \
                    nodes.text()
                time.sleep(0.05)
            while len(list(shm.glob("node-*/step_00000002/*.json"))) < 4:
                assert time.monotonic() < deadline, nodes.text()  # step 2 complete on both nodes
                time.sleep(0.05)
            with open(filler, "wb") as f:  # everything but 64 KiB
                f.write(b"\0" * (shutil.disk_usage(shm).free - (64 << 10)))
            while not any("ERROR memory snapshot of step" in p.read_text() for p in tmp_path.glob("node*.log")):
                assert time.monotonic() < deadline, nodes.text()
                time.sleep(0.05)
            filler.unlink()
            codes = nodes.wait()
        finally:
            nodes.stop()
    assert codes == {0: 0, 1: 0}, nodes.text()
    snapshots = read_metrics(run_dir, "memory_snapshot")
    failed = [e["step"] for e in snapshots if not e["committed"]]
    assert failed and min(failed) >= 4, snapshots
    assert any(e["committed"] and e["step"] > max(failed) for e in snapshots), snapshots
    _assert_bitwise(run_dir, baseline)


@pytest.mark.distributed
def test_one_ranks_failure_in_a_snapshot_fails_it_on_every_rank_and_the_next_ones_complete(tmp_path, pydoc_data):
    """Rank 1 alone fails inside the background half of a snapshot, past the agreement on the write:
    at step 6 after its replica arrived (an exception, as from a failed rename), at step 8 at the
    replica's first write, before its bytes arrive (ENOSPC: the rest of the stream must still be
    received), at step 10 at its commit files (ENOSPC). Every rank must count that snapshot as failed
    at the same agreement and go on in step: every other snapshot complete on both nodes (a rank that
    left the protocol early would leave its peer waiting out the tier's 20 s timeout, and every later
    snapshot failing)."""
    run_dir, steps = tmp_path / "run", 12
    faults = [{"kind": "exception", "phase": "memory_replica", "step": 6, "rank": 1},
              {"kind": "disk_full", "phase": "memory_replica_write", "step": 8, "rank": 1},
              {"kind": "disk_full", "phase": "memory_commit", "step": 10, "rank": 1}]
    args = overrides(run_dir, pydoc_data, tmp_path / "shm", [
        faults_override(faults), f"training.steps={steps}", "checkpoint.interval=0", "checkpoint.commit_timeout_s=20"])
    nodes = Nodes(tmp_path, args, max_restarts=0)
    codes = nodes.run_both()
    assert codes == {0: 0, 1: 0}, nodes.text()[-6000:]
    snapshots = {e["step"]: e["committed"] for e in read_metrics(run_dir, "memory_snapshot")}
    assert snapshots == {s: s not in (6, 8, 10) for s in range(MEMORY_INTERVAL, steps + 1, MEMORY_INTERVAL)}, \
        snapshots
    log = (tmp_path / "node1-2.log").read_text()
    assert all(f"memory snapshot of step {s} failed" in log for s in (6, 8, 10)), nodes.text()[-6000:]
    assert "no room for the replica of rank 0" in log, log[-6000:]


@pytest.mark.distributed
def test_a_failed_collective_of_the_tier_turns_it_off_on_every_rank_at_one_step(tmp_path, pydoc_data):
    """Rank 1 hangs 8 s before its commit of the snapshot of step 6: rank 0's agreement on the
    commit times out (the tier's timeout is 4 s), and the group can no longer be trusted to be in
    step. Every rank must turn the tier off at the same step boundary (the step's agreement carries
    the flag) and train to the end; a rank that kept snapshotting would wait out the timeout again."""
    run_dir, steps = tmp_path / "run", 12
    hang = {"kind": "hang", "phase": "memory_commit", "step": 6, "rank": 1, "hang_s": 8.0}
    args = overrides(run_dir, pydoc_data, tmp_path / "shm", [
        faults_override([hang]), f"training.steps={steps}", "checkpoint.interval=0", "checkpoint.commit_timeout_s=4"])
    nodes = Nodes(tmp_path, args, max_restarts=0)
    codes = nodes.run_both()
    assert codes == {0: 0, 1: 0}, nodes.text()[-6000:]
    assert sorted(step_losses(run_dir)) == list(range(1, steps + 1))
    [alarm] = [e for e in read_metrics(run_dir, "alarm") if e["check"] == "memory_tier_group"] or [None]
    assert alarm is not None and alarm["action"] == "memory_tier_off", nodes.text()[-6000:]
    off = f"memory snapshots are off from step {alarm['step']} for the rest of this attempt"
    assert all(off in (tmp_path / f"node{n}-{n + 1}.log").read_text() for n in (0, 1)), nodes.text()[-6000:]
    snapshots = {e["step"]: e["committed"] for e in read_metrics(run_dir, "memory_snapshot")}
    assert snapshots == {s: s < 6 for s in range(MEMORY_INTERVAL, alarm["step"] + 1, MEMORY_INTERVAL)}, snapshots


@pytest.mark.distributed
def test_a_snapshot_of_a_newer_format_is_refused_whatever_the_flags(tmp_path, pydoc_data):
    """Killed with snapshots in memory and no durable checkpoint yet; the node's snapshots then carry a manifest
    format this checkout does not know (a newer trainer's): the restart must stop with exit 2, naming both
    formats and the folder, also with allow_config_change, and leave the snapshots as they are."""
    from checkpoint.durable.manifest import FORMAT_VERSION

    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    kill = faults_override([{"kind": "sigkill", "phase": "step", "step": 7}])
    first = run_train(overrides(run_dir, pydoc_data, shm, [kill]), check=False)
    metas = sorted(shm.rglob("rank*.json"))
    assert first.returncode != 0 and metas
    for meta in metas:
        info = json.loads(meta.read_text())
        info["manifest"]["format_version"] = FORMAT_VERSION + 1
        meta.write_text(json.dumps(info))
    for extra in ([], ["checkpoint.allow_config_change=true"]):
        refused = run_train(overrides(run_dir, pydoc_data, shm, extra), check=False)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert f"manifest format {FORMAT_VERSION + 1}; this checkout reads formats up to {FORMAT_VERSION}" in \
            refused.stderr and "to resume from the durable tier" in refused.stderr, refused.stderr[-3000:]
        assert read_metrics(run_dir, "resume") == [] and sorted(shm.rglob("rank*.json")) == metas


@pytest.mark.distributed
def test_a_snapshot_taken_with_another_config_is_refused_like_a_durable_checkpoint(tmp_path, pydoc_data):
    """Killed with snapshots in memory and no durable checkpoint yet; restarted with other optimizer
    betas: the memory tier must refuse, as a durable resume would, not restore the old run's state."""
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    kill = faults_override([{"kind": "sigkill", "phase": "step", "step": 7}])
    first = run_train(overrides(run_dir, pydoc_data, shm, [kill]), check=False)
    assert first.returncode != 0 and list(shm.rglob("*.snap"))
    changed = run_train(overrides(run_dir, pydoc_data, shm, ["optim.beta2=0.99"]), check=False)
    assert changed.returncode != 0
    assert "were taken with another config" in changed.stderr and "checkpoint.allow_config_change=true" in \
        changed.stderr, changed.stderr[-3000:]
    assert read_metrics(run_dir, "resume") == []
    allowed = run_train(overrides(run_dir, pydoc_data, shm, ["optim.beta2=0.99",
                                                            "checkpoint.allow_config_change=true"]))
    assert "checkpoint.allow_config_change=true: the memory tier's snapshots" in allowed.stderr
    assert read_metrics(run_dir, "resume")[-1]["source"] == "memory"


@pytest.mark.distributed
@pytest.mark.parametrize("required", [True, False])
def test_one_node_short_of_memory_decides_for_every_rank(tmp_path, pydoc_data, required):
    """Node 1's memory root is a 4 MiB tmpfs (it needs ~10 MiB), node 0's has room; two ranks per node.
    Every rank takes the same decision: all stop at the pre-flight (required), or all train on the
    durable tier alone; a node deciding alone would leave its peer waiting in the tier's collectives."""
    root, per_node = tmp_path / "shm", 2
    with tmpfs(root / "node-1", 4):
        args = overrides(tmp_path / "run", pydoc_data, root, [f"checkpoint.memory.required={str(required).lower()}",
                                                               "training.steps=8",
                                                               f"training.global_batch_size={4 * per_node}"])
        nodes = Nodes(tmp_path, args, max_restarts=0, per_node=per_node)
        codes = nodes.run_both()
        text = nodes.text()
        assert not list(root.rglob("*.snap"))
    if required:
        assert codes == {0: 1, 1: 1}, text[-6000:]
        for node in (0, 1):  # both say why, with the short node's numbers and the fix
            said = (tmp_path / f"node{node}-{node + 1}.log").read_text()
            assert "the memory tier needs" in said and "MiB free of 4.00 MiB" in said, said[-3000:]
            assert "checkpoint.memory.required=false" in said, said[-3000:]
    else:
        assert codes == {0: 0, 1: 0}, text[-6000:]
        assert text.count("training on the durable tier alone") >= 2 * per_node, text[-6000:]
        assert read_metrics(tmp_path / "run", "memory_snapshot") == []
        committed = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
        assert committed == ["step_00000008"], committed  # the durable tier saved as configured
