"""Shared fixtures. Shared code lives in the ``helpers`` package (tests/helpers/), programs that
tests run as separate processes in tests/workers/."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.register_assert_rewrite("helpers")  # helpers' asserts report their values, as in a test module


@pytest.fixture(scope="session")
def pydoc_data(tmp_path_factory) -> Path:
    """The debug experiment's corpus (pydoc topics, byte tokenizer, its held-out validation split),
    prepared once per test session as data.prepare_if_missing builds it."""
    from tools.runs import prepare_debug_data

    return prepare_debug_data(tmp_path_factory.mktemp("data") / "pydoc-byte")
