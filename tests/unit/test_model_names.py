"""The model owns its names: product code outside model/ names none of the decoder's modules or
parameters, so a change of the model (a new FFN, a norm) touches model/ and a preset only. The TP
plan, the FSDP units, the Hugging Face names and the counts live in model/ (model/parallelize.py,
model/hf.py, model/counting.py); parallel/, checkpoint/, planner/ and the rest apply them.

The names are the model's own, read from it (the debug model built on the meta device: every module,
parameter and buffer name), not a hand list, so this cannot drift from the model. What counts as
naming one, in string literals (docstrings too) and attribute access of every product package but
model/ (train.py included; scripts/ and tests/ are not product code):
  - a dotted path of two or more of its names, layer indices as any number or a {placeholder}:
    "attention.wq", "feed_forward.w1.weight", "output.weight", f"layers.{i}";
  - one name that is no common word: with an underscore or a digit, or of 3 characters at most
    (tok_embeddings, ffn_norm, w1, wq), in any string or as an attribute (``model.tok_embeddings``);
  - a common word among its names (output, norm, layers, attention) only as a whole literal
    ("norm", or "layers." as a prefix) or an attribute that is not called (``model.norm``, not
    ``x.norm()``), so error messages and tensor methods do not count. The parameters' own names
    (weight, bias) are torch's and count only inside a dotted path.
"""

from __future__ import annotations

import ast
import re
from typing import Iterator, Set, Tuple

import torch
from test_layout import PACKAGES, ROOT

from model.config import ModelConfig
from model.llama import Transformer

LAYER = "N"  # a layer index, in the names as normalised here


def _model_names() -> Tuple[Set[str], Set[str]]:
    """(every module, parameter and buffer name, layer indices as N; the parameters' own names)."""
    with torch.device("meta"):
        model = Transformer(ModelConfig(tie_embeddings=False))  # the output layer's weight under its own name
    params = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    named = [name for name, _ in [*model.named_modules(remove_duplicate=False),
                                  *model.named_buffers(remove_duplicate=False)]] + params
    return ({re.sub(r"(?<=\.)\d+(?=\.|$)", LAYER, name) for name in named if name},
            {name.rsplit(".", 1)[-1] for name in params})


NAMES, LEAVES = _model_names()  # LEAVES: weight (a bias would join it), names torch gives every Linear
PARTS = {part for name in NAMES for part in name.split(".")} - {LAYER}
DISTINCT = {p for p in PARTS if "_" in p or any(c.isdigit() for c in p) or len(p) <= 3} - LEAVES
COMMON = PARTS - DISTINCT - LEAVES
PATHS = {".".join(parts[i:j]) for name in NAMES for parts in [name.split(".")]
         for i in range(len(parts)) for j in range(i + 2, len(parts) + 1) if parts[i] != LAYER}
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.(?:\w+|\{[^{}]*\}))*")


def named_in_text(text: str) -> Set[str]:
    """The model's names ``text`` holds (a string literal of the product code)."""
    found = set()
    for run in DOTTED.findall(text):
        parts = [LAYER if p.isdigit() or p.startswith("{") else p for p in run.split(".")]
        found |= {p for p in parts if p in DISTINCT}
        found |= {".".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 2, len(parts) + 1)} & PATHS
    whole = text.strip()
    if whole in COMMON or (whole.endswith(".") and whole[:-1] in COMMON):
        found.add(whole)
    return found


def product_names() -> Iterator[Tuple[str, int, str]]:
    """(file, line, what) for every name of the model in product code outside model/."""
    files = [ROOT / "train.py"] + [p for pkg in PACKAGES if pkg != "model" for p in sorted((ROOT / pkg).rglob("*.py"))]
    for path in files:
        where = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=where)
        called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in sorted(named_in_text(node.value)):
                    yield where, node.lineno, f'"{name}" in a string'
            elif isinstance(node, ast.Attribute) and (node.attr in DISTINCT or
                                                      node.attr in COMMON and id(node) not in called):
                yield where, node.lineno, f".{node.attr}"


def test_the_rule_sees_the_names_and_passes_common_words():
    """The matcher itself, on the forms the product code had before the model owned its names."""
    assert {"tok_embeddings", "attention_norm", "ffn_norm", "feed_forward", "wq", "w1"} <= DISTINCT
    assert {"output", "norm", "layers", "attention"} <= COMMON and "weight" in LEAVES
    assert named_in_text('"attention.wq": ColwiseParallel()') == {"attention.wq", "wq"}
    assert named_in_text("layers.{i}.feed_forward.w2.weight") >= {"layers.N.feed_forward.w2.weight", "w2"}
    assert named_in_text("output.weight") == {"output.weight"} and named_in_text("layers.") == {"layers."}
    for ordinary in ("the output of the norm", "weight", "n_layers", "model.output_dir", "grad_norm"):
        assert named_in_text(ordinary) == set(), ordinary


def test_no_product_code_outside_model_names_the_model():
    found = [f"{where}:{line}: {what}" for where, line, what in product_names()]
    assert not found, ("product code outside model/ names the model's modules or parameters; say it in "
                       "model/ (parallelize.py, hf.py, counting.py) and use that:\n" + "\n".join(found))
