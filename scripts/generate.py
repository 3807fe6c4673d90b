"""Sample text from a trained model: a committed checkpoint (any layout), an export of it, or a Hugging Face
Llama folder.

  python scripts/generate.py outputs/debug/checkpoints/step_00000300 --prompt "The import statement"
  python scripts/generate.py CKPT --prompt "Lists" --temperature 0 --max-new-tokens 120   # greedy
  python scripts/generate.py out/model.safetensors --data outputs/data/pydoc-byte --prompt "..."

A checkpoint directory (step_N, with manifest.json) holds the model's shape in its manifest and
its tokenizer: the one a checkpoint converted from a Hugging Face folder keeps (the folder's
tokenizer.json, checkpoint/interop/from_hf.py), else that of the data it trained on (its data.path;
data/tokenizer.py). ``--data`` overrides both, and an export (scripts/export.py's .safetensors) needs it.
Decoding uses a KV cache (model/kv_cache.py). ``--temperature 0`` is greedy and deterministic; sampling
is seeded by ``--seed``. Generation stops at the end-of-document token or after ``--max-new-tokens``;
weights that came from a Hugging Face folder (a converted folder, or a run from ``model.init_from``) stop
where the folder's generation_config.json (else config.json) says, which the manifest's ``init_from``
record keeps, so a checkpoint generates what the folder generates.

  python scripts/generate.py /models/Llama-3.2-1B --prompt "The capital of France is" --temperature 0

A Hugging Face folder gives the weights (safetensors), the shape (config.json, model=hf's reading)
and the tokenizer (its tokenizer.json, run with the tokenizers package as transformers' fast
tokenizer does, special tokens such as BOS added by its post-processor); generation stops at any
of config.json's eos_token_id (generation_config.json's when present). Greedy output equals
transformers' ``generate(do_sample=False)`` on the same folder (tests/integration/test_generate.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import torch

from checkpoint.durable.manifest import read_manifest
from checkpoint.interop.export import load_tensors
from data.formats.native import load_tokenizer
from data.tokenizer import TOKENIZER_JSON, FileTokenizer
from model.config import ModelConfig
from model.generation import Sampling, generate
from model.llama import build_model


class Loaded(NamedTuple):
    model: torch.nn.Module
    data: Optional[Path]  # the prepared dataset the model was trained on (its tokenizer), if known
    train_seq_len: Optional[int]  # positions the model was trained on, if known
    source: str
    tokenizer: Optional[object] = None  # a Hugging Face folder's own tokenizer, or the one a checkpoint keeps
    stop_ids: Optional[List[int]] = None  # the eos_token_id(s) of the folder the weights came from


def hf_stop_ids(config: Optional[Dict], generation: Optional[Dict],
                eos_id: Optional[int] = None) -> Optional[List[int]]:
    """Where transformers' generate stops on a folder: generation_config.json's eos_token_id (an id or a
    list), else config.json's; ``eos_id`` (the tokenizer's) when neither names one; None without either file."""
    if config is None and generation is None:
        return None
    eos = {**(config or {}), **(generation or {})}.get("eos_token_id")
    if eos is None:
        return None if eos_id is None else [eos_id]
    return list(eos) if isinstance(eos, list) else [eos]


def _config_data_path(config: Dict) -> Optional[Path]:
    data = config.get("data", {})
    mixture = data.get("mixture") or []
    path = mixture[0]["path"] if mixture else data.get("path")
    return Path(path) if path else None


def _build(model_cfg: Dict, tensors: Dict[str, torch.Tensor], device: str) -> torch.nn.Module:
    model = build_model(ModelConfig(**model_cfg), device=device, seed=0)
    model.load_state_dict(tensors, strict=True)  # copies (and casts an export's bf16) into the fp32 weights
    return model.eval()


def load(path: Path, weights: str = "model", device: str = "cpu", verify: bool = True) -> Loaded:
    """The model in ``path``: a committed checkpoint directory or a .safetensors export."""
    path = Path(path)
    if path.is_dir() and (path / "manifest.json").is_file():
        manifest = read_manifest(path)
        tensors = load_tensors(path, prefix=f"{weights}.", verify=verify)  # checksums every file, the tokenizer's too
        model = _build(manifest.config["model"], tensors, device)
        kept = FileTokenizer.from_file(path / TOKENIZER_JSON) if TOKENIZER_JSON in manifest.files else None
        record = manifest.init_from or {}  # the folder the weights came from (checkpoint/interop/init_from.py)
        return Loaded(model, _config_data_path(manifest.config), manifest.config.get("training", {}).get("seq_len"),
                      f"{path} ({weights} weights of step {manifest.step})", kept,
                      hf_stop_ids(record.get("hf_config"), record.get("hf_generation_config")))
    if path.is_file() and path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if "model" not in meta:
            raise ValueError(f"{path} has no 'model' entry in its metadata: not an export of this project "
                             "(scripts/export.py writes one)")
        model = _build(json.loads(meta["model"]), load_file(str(path)), device)
        return Loaded(model, None, None, f"{path} ({meta.get('weights', 'model')} weights of step {meta.get('step')})")
    if path.is_dir() and (path / "config.json").is_file():
        return _load_hf(path, device)
    raise ValueError(f"{path}: expected a committed checkpoint directory (with manifest.json) or a .safetensors "
                     "file written by scripts/export.py")


def _load_hf(path: Path, device: str) -> Loaded:
    """A Hugging Face Llama folder: its weights, shape, tokenizer and end-of-text ids."""
    from checkpoint.interop.from_hf import folder_model_config, hf_tensors

    cfg = folder_model_config(path)
    model = build_model(cfg, device=device, seed=0)
    model.load_state_dict(dict(hf_tensors(path, cfg, list(model.state_dict()))), strict=True)
    if not (path / TOKENIZER_JSON).is_file():
        raise ValueError(f"{path} has no tokenizer.json: the folder's tokenizer decodes the ids")
    tokenizer = FileTokenizer.from_file(path / TOKENIZER_JSON)
    generation = path / "generation_config.json"
    stops = hf_stop_ids(json.loads((path / "config.json").read_text()),
                        json.loads(generation.read_text()) if generation.is_file() else None, tokenizer.eos_id)
    return Loaded(model.eval(), None, None, f"{path} (Hugging Face folder)", tokenizer, stops)


def tokenizer_of(loaded: Loaded, model: Path, data: Optional[Path]):
    """The tokenizer that encodes the prompt and decodes the ids: ``--data``'s, else the model's own (a
    Hugging Face folder's, or the one a converted checkpoint keeps), else that of the dataset it trained on."""
    if data is None and loaded.tokenizer is not None:
        return loaded.tokenizer
    path = data or loaded.data
    if path is not None and (Path(path) / "meta.json").is_file():
        return load_tokenizer(path)
    if data is not None:
        raise ValueError(f"--data {data}: no prepared dataset there (no meta.json); pass the dataset the model "
                         "was trained on")
    if path is None:
        raise ValueError(f"{model} names no dataset and keeps no {TOKENIZER_JSON}: pass --data DIR, the dataset "
                         "the model was trained on (or one prepared with its tokenizer)")
    raise ValueError(f"{model} was trained on data.path={path}, which holds no prepared dataset now (no meta.json), "
                     f"and keeps no {TOKENIZER_JSON}: pass --data DIR, a dataset prepared with the same tokenizer")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a committed step_N checkpoint directory, a .safetensors export, or a "
                   "Hugging Face Llama folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (deterministic)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling; 1: off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=None,
                   help="prepared dataset whose tokenizer to use (default: the model's own: a Hugging Face folder's "
                        "or a converted checkpoint's tokenizer.json, else the checkpoint's data.path)")
    p.add_argument("--weights", choices=["model", "ema"], default="model", help="a checkpoint's weights or their EMA")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    try:
        sampling = Sampling(a.temperature, a.top_k, a.top_p)
        loaded = load(a.model, a.weights, a.device)
        tokenizer = tokenizer_of(loaded, a.model, a.data)
        prompt = tokenizer.encode(a.prompt)
        generator = torch.Generator(device=a.device).manual_seed(a.seed)
        new = generate(loaded.model, prompt, a.max_new_tokens, sampling, generator,
                       stop_id=loaded.stop_ids or tokenizer.eos_id, vocab_limit=tokenizer.vocab_size)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if loaded.train_seq_len and len(prompt) + len(new) > loaded.train_seq_len:
        print(f"note: {len(prompt) + len(new)} positions, past training.seq_len={loaded.train_seq_len}, which the "
              "model was never trained on; the text there may degrade", file=sys.stderr)
    print(tokenizer.decode(prompt + new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
