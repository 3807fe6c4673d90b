"""RNG restore on CUDA machines, without one: only the current device's generator is restored, and
another device count than at save time (a restart under another CUDA_VISIBLE_DEVICES) is not an
error. torch.cuda is replaced by a recorder."""

from __future__ import annotations

import pytest
import torch

from checkpoint.state.training_state import capture_rng, restore_rng


@pytest.fixture
def cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": calls.append(("one", s)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: calls.append(("all", s)))
    return calls


def test_only_this_ranks_device_is_restored(cuda):
    state = capture_rng() | {"torch_cuda": torch.tensor([7], dtype=torch.uint8)}
    restore_rng(state)
    assert [(kind, s.tolist()) for kind, s in cuda] == [("one", [7])]


def test_an_old_all_devices_state_restores_this_device_and_tolerates_another_count(cuda):
    saved = [torch.tensor([i], dtype=torch.uint8) for i in range(4)]  # saved where 4 devices were visible
    restore_rng(capture_rng() | {"torch_cuda": saved})
    assert [(kind, s.tolist()) for kind, s in cuda] == [("one", [3])]  # device 3's, not a RuntimeError
    cuda.clear()
    restore_rng(capture_rng() | {"torch_cuda": saved[:2]})  # device 3 was not visible then: left as seeded
    assert cuda == []
