"""Shared fixtures. Shared code lives in the ``helpers`` package (tests/helpers/), programs that
tests run as separate processes in tests/workers/."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.register_assert_rewrite("helpers")  # helpers' asserts report their values, as in a test module


@pytest.fixture(scope="session")
def pydoc_data(tmp_path_factory) -> Path:
    """The default corpus (pydoc topics, byte tokenizer), prepared once per test session."""
    from data.token_file import prepare_token_file

    out = tmp_path_factory.mktemp("data") / "pydoc-byte"
    prepare_token_file(out, ["pydoc"], "byte")
    return out
