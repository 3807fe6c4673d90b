"""Run by test_layout.py in a fresh interpreter (the test process has torch imported already):
config validation must not import torch, and a training run must not import the tools package."""

import sys

import configs.constants  # noqa: F401
import configs.schema  # noqa: F401
import trainer.checks  # noqa: F401

assert "torch" not in sys.modules, "config validation imported torch"

from trainer import run  # noqa: E402, F401  (the module, as a run imports it)

tools = sorted(m for m in sys.modules if m == "tools" or m.startswith("tools."))
assert not tools, f"a training run imported {tools}"
print("ok")
