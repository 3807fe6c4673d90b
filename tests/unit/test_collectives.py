"""The product's collectives are legal on NCCL: all of them go through parallel/collectives.py, and
there every tensor goes only to a group whose backend takes its device.

gloo takes CPU and CUDA tensors alike, so a CPU run cannot see NCCL's rule; here stand-in groups
with NCCL's and gloo's device lists record every tensor they are sent."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from parallel import collectives
from recovery.runtime import Preemption, StragglerMonitor
from training.grad_stats import GradStats

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("configs", "model", "data", "parallel", "training", "metrics", "checkpoint", "recovery", "trainer",
           "planner", "rehearsal")
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object",
    "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "send_object_list", "recv_object_list", "new_group", "new_subgroups",
    "all_reduce_coalesced", "all_gather_coalesced",
}


def _distributed_calls(path: Path):
    """(line, name) of every torch.distributed collective ``path`` names, however it imports it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = {"torch.distributed"}  # names bound to the torch.distributed module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed",
                                                                 "torch.distributed.distributed_c10d"):
            for a in node.names:
                if a.name in COLLECTIVES:
                    yield node.lineno, a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            owner = ast.unparse(node.value)
            if owner in aliases or owner.endswith("distributed_c10d"):
                yield node.lineno, node.attr


def test_no_product_collective_outside_the_collectives_module():
    home = ROOT / "parallel" / "collectives.py"
    files = [ROOT / "train.py"] + [p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))]
    found = [f"{p.relative_to(ROOT)}:{line}: torch.distributed.{name}" for p in files if p != home
             for line, name in _distributed_calls(p)]
    assert not found, "collectives outside parallel/collectives.py (route them through it):\n" + "\n".join(found)
    assert list(_distributed_calls(home)), "the scan finds nothing even in the collectives module: it is broken"


def test_the_scan_sees_every_spelling(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nimport torch.distributed as d\nfrom torch import distributed as dd\n"
                      "from torch.distributed import barrier\n"
                      "d.all_reduce(t)\ndd.broadcast_object_list(x)\ntorch.distributed.isend(t, 1)\nf = d.send\n")
    assert sorted(name for _, name in _distributed_calls(sample)) == [
        "all_reduce", "barrier", "broadcast_object_list", "isend", "send"]


# -- stand-in groups ------------------------------------------------------------------------------
ACCELERATOR = "meta"  # stands in for cuda: a device that is not the host


class Group:
    def __init__(self, name: str, devices, size: int = 4):
        self.name, self.devices, self.size = name, devices, size


class RecordingDist:
    """The slice of torch.distributed the helpers call, recording (op, device, group) per tensor."""

    class ReduceOp:
        SUM, MAX = "sum", "max"

    class Backend:
        backend_capability = {}

    def __init__(self, default: Group):
        self.group = type("group", (), {"WORLD": default})
        self.sent = []

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_rank(self, group=None):
        return 0

    def get_world_size(self, group=None):
        return (group or self.group.WORLD).size

    def get_backend_config(self, group=None):
        g = group or self.group.WORLD
        return ",".join(f"{d}:{g.name}" for d in g.devices)

    def new_group(self, backend=None, timeout=None):
        return Group(backend, ("cpu", ACCELERATOR))

    def _record(self, op, tensor, group):
        self.sent.append((op, tensor.device.type, (group or self.group.WORLD).name))

    def all_reduce(self, tensor, op=None, group=None):
        self._record("all_reduce", tensor, group)

    def all_gather(self, out, tensor, group=None):
        self._record("all_gather", tensor, group)
        for o in out:
            o.copy_(tensor) if tensor.device.type != "meta" else None

    def broadcast_object_list(self, objs, src=0, group=None):
        self.sent.append(("broadcast_object_list", "cpu", (group or self.group.WORLD).name))

    def all_gather_object(self, out, obj, group=None):
        self.sent.append(("all_gather_object", "cpu", (group or self.group.WORLD).name))
        out[:] = [obj] * len(out)

    def barrier(self, group=None):
        self.sent.append(("barrier", "cpu", (group or self.group.WORLD).name))


@pytest.fixture
def cuda_world(monkeypatch):
    """A 4-rank job on an accelerator: the default group is NCCL (accelerator tensors only)."""
    fake = RecordingDist(Group("nccl", (ACCELERATOR,)))
    monkeypatch.setattr(collectives, "dist", fake)
    monkeypatch.setattr(collectives, "_control", None)
    monkeypatch.setattr(collectives, "_devices", {})
    collectives.init_control_group(60.0)
    return fake


def test_control_values_go_to_gloo_and_model_tensors_stay_on_the_device(cuda_world):
    assert collectives.control_group().name == "gloo"  # made at start-up, beside the NCCL default group
    collectives.any_rank(True)
    collectives.agree_max([1.0, 2.0])
    collectives.gather_floats(0.5)
    collectives.decided_on_rank0(lambda: "step_00000010")
    collectives.all_gather_object({"rank": 0})
    collectives.barrier()
    collectives.broadcast_object([1, None])
    # the product's own per-step and periodic agreements, as the loop calls them
    Preemption(grace_s=1).agree(False)
    StragglerMonitor(interval=1, factor=2.0).record(1, 0.1)
    # model tensors: on the accelerator, on the training group
    collectives.all_reduce(torch.zeros(2, device=ACCELERATOR))
    collectives.all_gather(torch.zeros((), dtype=torch.int64, device=ACCELERATOR))
    for op, device, group in cuda_world.sent:
        assert device in {"nccl": (ACCELERATOR,), "gloo": ("cpu", ACCELERATOR)}[group], (op, device, group)
    assert [g for op, _, g in cuda_world.sent if op in ("all_reduce", "all_gather")][-2:] == ["nccl", "nccl"]
    assert {g for op, _, g in cuda_world.sent[:-2]} == {"gloo"}


def test_the_steps_flags_ride_the_training_groups_reduction_on_the_device(cuda_world):
    """The flags every rank must act on at one step (preemption, a failed save) are built on the
    training device and sent in the step's one all-reduce, to the NCCL group: no CPU tensor, no gloo."""
    stats = GradStats(None, torch.device(ACCELERATOR), groups={})
    with pytest.raises(NotImplementedError):  # the host read of a stand-in device: after the send
        stats.reduce(torch.zeros((), dtype=torch.float64, device=ACCELERATOR), 1, flags=[True, False])
    assert cuda_world.sent == [("all_reduce", ACCELERATOR, "nccl")]


def test_a_cpu_tensor_on_an_nccl_group_is_refused_before_it_is_sent(cuda_world):
    with pytest.raises(RuntimeError, match=r"a cpu tensor sent to the default group \(meta:nccl\), whose backend "
                                           r"takes only \['meta'\] tensors"):
        collectives.all_reduce(torch.zeros(2))
    with pytest.raises(RuntimeError, match="all_gather: a cpu tensor"):
        collectives.all_gather(torch.zeros(1))
    assert cuda_world.sent == []  # nothing reached the group


def test_on_a_cpu_run_the_control_group_is_the_default_group(monkeypatch):
    fake = RecordingDist(Group("gloo", ("cpu", ACCELERATOR)))
    monkeypatch.setattr(collectives, "dist", fake)
    monkeypatch.setattr(collectives, "_control", None)
    monkeypatch.setattr(collectives, "_devices", {})
    assert collectives.init_control_group(60.0) is fake.group.WORLD  # no second gloo group on CPU
    collectives.all_reduce(torch.zeros(1))
    assert fake.sent == [("all_reduce", "cpu", "gloo")]


def test_problems_by_rank_names_the_ranks_that_met_each_and_at_most_eight():
    """One wording for every agreed block (start-up, pre-flight, the memory tier's room): a problem
    every rank met once, plain; one some ranks met, with the first eight of them."""
    per_rank = [["disk full"], ["disk full", "no /dev/shm"], ["disk full"]]
    assert collectives.problems_by_rank(per_rank) == ["disk full", "no /dev/shm (on 1 of 3 ranks: 1)"]
    many = [["slow"] if r % 2 else [] for r in range(512)]
    assert collectives.problems_by_rank(many) == ["slow (on 256 of 512 ranks: 1, 3, 5, 7, 9, 11, 13, 15, ...)"]
    assert collectives.problems_by_rank([[], []]) == []


class _TwoIdenticalReplicas:
    """A stand-in torchft manager: the other replica group holds the same values, so a sum doubles them."""

    def __init__(self):
        self.messages = []

    def allreduce(self, tensor, reduce_op):
        assert reduce_op == torch.distributed.ReduceOp.SUM  # summed, not torchft's default average
        self.messages.append(tensor.dtype)
        tensor.mul_(2)
        return type("Work", (), {"wait": lambda self: True})()


def test_replica_sums_are_one_message_per_dtype_written_back_in_place():
    loss = torch.tensor(3.5, dtype=torch.float64)
    grads = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(4, dtype=torch.float32)]
    manager = _TwoIdenticalReplicas()
    collectives.all_reduce_across_replicas([loss] + grads, manager)
    assert sorted(map(str, manager.messages)) == ["torch.float32", "torch.float64"]
    assert loss.item() == 7.0 and grads[0].shape == (2, 3)
    assert torch.equal(grads[0], 2 * torch.arange(6, dtype=torch.float32).view(2, 3))
    assert torch.equal(grads[1], torch.full((4,), 2.0))
