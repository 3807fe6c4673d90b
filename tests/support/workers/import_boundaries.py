"""Run by test_layout.py in a fresh interpreter (the test process has torch imported already): the config and
the checks of its values must not import torch, and a training run must not import the planner or the
rehearsal kit."""

import sys

import trainer.config  # noqa: F401

assert "torch" not in sys.modules, "the config and its value checks imported torch"

from trainer import run  # noqa: E402, F401  (the module, as a run imports it)

extra = sorted(m for m in sys.modules if m.split(".")[0] in ("planner", "rehearsal"))
assert not extra, f"a training run imported {extra}"
print("ok")
