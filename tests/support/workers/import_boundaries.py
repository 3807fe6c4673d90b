"""Run by test_layout.py in a fresh interpreter (the test process has torch imported already): the config and
the checks of its values must not import torch, a training run must not import the planner or the rehearsal
kit, and the training process (trainer.run and what train.py imports) holds no code of the offline data
preparation nor the packages of other engines."""

import ast
import importlib
import sys
from pathlib import Path

import trainer.config  # noqa: F401

assert "torch" not in sys.modules, "the config and its value checks imported torch"

from trainer import run  # noqa: E402, F401  (the module, as a run imports it)

extra = sorted(m for m in sys.modules if m.split(".")[0] in ("planner", "rehearsal"))
assert not extra, f"a training run imported {extra}"

TRAIN_PY = Path(__file__).resolve().parents[3] / "train.py"
for node in ast.parse(TRAIN_PY.read_text()).body:  # what train.py imports (nothing imports train.py itself)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        for name in [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]:
            importlib.import_module(name)

# The preparation (data/prep/) by its package and by its entry points wherever they live: tokenize a
# corpus, read its files, write token files, train a BPE. A run prepares data.path in a process of its own.
ENTRY_POINTS = ("prepare_token_file", "prepare_shards", "iter_documents", "train_bpe")
prep = sorted(m for m in sys.modules if m == "data.prep" or m.startswith("data.prep."))
prep += sorted(f"{name}.{entry}" for name, module in list(sys.modules.items()) if name.split(".")[0] == "data"
               for entry in ENTRY_POINTS if hasattr(module, entry))
assert not prep, f"a training run imported the data preparation: {prep}"
engines = sorted(m for m in sys.modules if m.split(".")[0] in ("datatrove", "megatron"))
assert not engines, f"a training run imported other engines' packages: {engines}"
print("ok")
