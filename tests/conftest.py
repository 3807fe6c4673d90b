"""Shared fixtures and the suite's order. Tests live in tests/unit/ (no process started) and tests/integration/
(real processes); shared code in the ``support`` package (tests/support/), programs that tests run as separate
processes in tests/support/workers/.

The suite runs on three pytest-xdist workers, a file per worker at a time (``-n 3 --dist loadfile``
in pyproject.toml): one file's module fixtures (a shared training run) are built once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.register_assert_rewrite("support")  # support's asserts report their values, as in a test module

# The files that take longest (seconds of one worker in the suite on the idle 2-core machine, the other
# worker busy too; 2026-12-03), started first so that the workers end together rather than one
# waiting for the others.
SLOWEST_FIRST = (
    "test_memory_tier.py",  # 237 s: two torchrun agents as two nodes
    "test_s3_checkpoints.py",  # 105 s: 2-rank runs against a local S3 server
    "test_preemption_torchrun.py",  # 89 s
    "test_train_run.py",  # 82 s: the 300-step debug experiment
    "test_replacement_node.py",  # 80 s: two launcher agents, one lost and replaced
    "test_export_memory.py",  # 74 s
    "test_init_memory.py",  # 71 s
    "test_rendezvous_store.py",  # 63 s
    "test_checkpoint_reshard.py",  # 63 s
    "test_gpu_check.py",  # 59 s: scripts/gpu_check.py --dry-run
    "test_agreement.py",  # 59 s
    "test_s3_protocol.py",  # 49 s: a process killed at each phase of an S3 save, and the restart
    "test_save_errors.py",  # 46 s
    "test_parallel.py",  # 43 s
    "test_checkpoint_trust.py",  # 40 s
    "test_recovery_launch.py",  # 40 s
    "test_fault_tolerance.py",  # 40 s: two torchft replica groups, one killed and restarted
    "test_recovery_elastic.py",  # 35 s
    "test_async_process.py",  # 33 s: writer processes start an interpreter per rank
    "test_data_engines.py",  # datatrove's executor, megatron-core's writer
    # then the fast loop's longest (-m "not distributed", seconds of one worker, 2026-12-05)
    "test_bad_inputs.py",  # 20 s: every numeric key through the whole pre-flight
    "test_layout.py",  # 12 s: every module's imports; a fresh interpreter imports a run
    "test_plan_activations.py",  # 12 s
    "test_meta_70b.py",  # 10 s: 70B under its 512-rank plan on the meta device
    "test_docs.py",  # 9 s
    "test_watchdog.py",  # 8 s
)


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def pydoc_data(tmp_path_factory) -> Path:
    """The debug experiment's corpus (pydoc topics, byte tokenizer, its held-out validation split),
    prepared once per test session as data.prepare_if_missing builds it."""
    from rehearsal.runs import prepare_debug_data

    return prepare_debug_data(tmp_path_factory.mktemp("data") / "pydoc-byte")


def pytest_configure(config):
    """Compute in the tests' own processes with one thread, as in the runs they start
    (OMP_NUM_THREADS=1): two workers share the two cores."""
    import torch

    torch.set_num_threads(1)
