"""What the S3 test files (test_s3_protocol.py, test_s3_checkpoints.py) and tests/support/workers/s3_save_worker.py
share: the local S3 server (rehearsal/s3_server.py: moto on 127.0.0.1) with its bucket and this process's
environment pointed at it while it runs, the bucket's prefixes and its open multipart uploads; a small
training state saved and resumed by the real CheckpointManager in one process (the state, its tensors,
the composed config and the manager); and KILL_POINTS, where the worker SIGKILLs itself during a save."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

from checkpoint.storage import Loc, location
from rehearsal.s3_server import BUCKET, S3Server


@contextmanager
def serving() -> Iterator[S3Server]:
    """A started server holding the bucket BUCKET; this process reads and writes it through the
    environment (``server.env``) until the block ends, then the server stops."""
    server = S3Server().start()
    saved = {k: os.environ.get(k) for k in server.env}
    try:
        server.make_bucket()
        os.environ.update(server.env)
        yield server
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        server.stop()


def in_bucket(name: str) -> Loc:
    """The prefix ``name`` of BUCKET (``s3://BUCKET/name``): a test's own part of the bucket."""
    return location(f"s3://{BUCKET}/{name}")


def keys(prefix: Loc) -> List[str]:
    """Every object under ``prefix``, named relative to it."""
    return sorted(e.name for e in prefix.walk())


def copy_tree(src: Loc, dst: Loc) -> None:
    """Every object under ``src`` again under ``dst`` (a test's own copy of a shared fixture)."""
    for name in keys(src):
        (dst / name).write_bytes((src / name).read_bytes())


def open_uploads(server: S3Server, prefix: str = "") -> List[dict]:
    """The multipart uploads started under ``prefix`` (a key prefix of BUCKET) and neither completed
    nor aborted."""
    listed = server.client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)
    return listed.get("Uploads", [])


# -- a small training state saved and resumed by the real CheckpointManager, in one process --------
def tiny_state(step: int, trajectory: int = 0):
    """A TrainingState at ``step`` whose every tensor depends on (step, trajectory): two 256x256
    layers with AdamW's moments, about 1.5 MiB in a checkpoint (six 256 KiB parts)."""
    import torch

    from checkpoint.state.training_state import TrainingState

    torch.manual_seed(1000 * trajectory + step)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(4, 256)).square().sum().backward()
    opt.step()
    sched.step()
    state = TrainingState(model, opt, sched)
    state.step, state.tokens, state.samples = step, 64 * step, 4 * step
    return state


def tensors_of(state) -> dict:
    """The state's model and optimizer tensors, by name (what a resume must restore bit for bit)."""
    out = {f"model.{k}": v.detach().clone() for k, v in state.model.state_dict().items()}
    for pid, moments in state.optimizer.state_dict()["state"].items():
        out.update({f"optim.{pid}.{k}": v.clone() for k, v in moments.items() if hasattr(v, "clone")})
    return out


def adopt(state, other) -> None:
    """Make ``state`` hold ``other``'s tensors and counters (a run that trained on to other.step)."""
    state.model.load_state_dict(other.model.state_dict())
    state.optimizer.load_state_dict(other.optimizer.state_dict())
    state.step, state.tokens, state.samples = other.step, other.tokens, other.samples


def protocol_config(root: str, **checkpoint):
    """The trainer's composed config (configs/), saving to ``root`` synchronously every 2 steps and
    keeping 2, resolved to plain values (as a worker process reads it back from YAML)."""
    from omegaconf import OmegaConf

    from support.config import compose

    global _composed
    if _composed is None:  # composed once per process (Hydra takes seconds)
        _composed = OmegaConf.to_container(compose(), resolve=True)
    cfg = OmegaConf.create(_composed)
    for k, v in {"dir": root, "async_mode": "sync", "interval": 2, "keep_last": 2, **checkpoint}.items():
        OmegaConf.update(cfg, f"checkpoint.{k}", v)
    return cfg


_composed = None


@contextmanager
def manager(cfg, state, fault_hook=None, rank: int = 0, world_size: int = 1):
    """A CheckpointManager of one process (or of rank ``rank`` of a started process group), run as
    trainer/run.py runs it: the lease, pre-flight, rank 0's heartbeat, and on leaving the save's and
    retention's end and the lease released."""
    import torch

    from checkpoint.durable.lease import Heartbeat
    from parallel.dims import ParallelDims
    from trainer.config import typed
    from trainer.preflight import claim_lease
    from trainer.run import checkpoint_manager

    layout = ParallelDims(1, world_size, 1, world_size).layout
    mgr = checkpoint_manager(typed(cfg)[0], state, rank, world_size, layout, torch.device("cpu"),
                             fault_hook=fault_hook)
    mgr.preflight(claim_lease(cfg.checkpoint))
    beat = Heartbeat(mgr.root, mgr.saver.attempt, cfg.checkpoint.lease_timeout_s) if rank == 0 else None
    try:
        yield mgr
        mgr.close()  # waits for the save in flight and for retention
    finally:
        mgr._housekeeping.shutdown(wait=True)
        if beat is not None:
            beat.stop()


# Where tests/support/workers/s3_save_worker.py SIGKILLs itself during an S3 save, in the order of the protocol
# (docs/checkpoint-format.md): ("hook", phase) is the saver's fault hook at that phase; ("call", method,
# key suffix, n) is right after the n-th matching call of the S3 client returned (the server has done
# it, nothing after it ran).
KILL_POINTS = {
    "re-save of a BAD step: parts sent, the upload not completed": ("call", "upload_part", "", 2),
    "re-save of a BAD step: committed, latest not moved": ("call", "put_object", "/manifest.json", 1),
    "upload: parts sent, the upload not completed": ("call", "upload_part", "", 2),
    ".metadata: written, not acknowledged": ("call", "put_object", "/.metadata", 1),
    "uploaded, not acknowledged": ("hook", "checkpoint_write"),
    "acknowledged, no manifest": ("hook", "checkpoint_commit"),
    "manifest written, latest not moved": ("call", "put_object", "/manifest.json", 1),
    "committed, retention not begun": ("hook", "checkpoint_committed"),
    "retention: the manifest deleted, the objects not": ("hook", "checkpoint_retention"),
}


@contextmanager
def answer_lost(key_suffix: str, meanwhile: Optional[Callable[[], None]] = None) -> Iterator[List[str]]:
    """The answer to the first conditional PUT (If-None-Match) of a key ending in ``key_suffix`` that the
    server accepted is lost on its way back: botocore retries the PUT as it does after a dropped connection or
    a read timeout, and the retry meets the object the first request created. ``meanwhile`` runs before the
    retry (another writer's PUT). Yields the URLs so dropped."""
    from checkpoint.storage.s3 import store

    dropped: List[str] = []

    def drop(response, request_dict, **kw):
        http = response[0] if response else None
        url = request_dict["url"].split("?")[0]
        if (not dropped and http is not None and http.status_code == 200 and url.endswith(key_suffix)
                and "If-None-Match" in request_dict["headers"]):
            dropped.append(url)
            if meanwhile is not None:
                meanwhile()
            return 0  # retry at once, as botocore does after a lost answer
        return None

    events = store.client().meta.events
    events.register_first("needs-retry.s3.PutObject", drop, unique_id="answer-lost")
    try:
        yield dropped
    finally:
        events.unregister("needs-retry.s3.PutObject", unique_id="answer-lost")
