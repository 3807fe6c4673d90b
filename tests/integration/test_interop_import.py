"""model.init_from, proven with transformers itself: a LlamaForCausalLM with random weights (every
tensor random, norms too, so a swapped name or a wrong permutation shows) saved by
``save_pretrained`` is imported into the parallelised model at 1 process, dp_shard 2, tp 2 and
dp_shard 2 x tp 2, and the project's logits equal HF's; each rank reads only about its share of
the bytes; the imported weights exported again are HF's tensors bit for bit; a training run's
first loss equals HF's loss on the same batch; a resumed run ignores init_from.

Tolerances (fp32, the same weights, two implementations: only the order of floating-point
operations differs): logits |diff| <= 1e-4 x max |logit| (measured <= 6e-7); same argmax at
every position; first training loss |diff| <= 1e-5 x loss.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

from checkpoint.interop.weight_source import read_safetensors_header, source_problems
from configs.keys import ConfigError
from metrics.records import read_metrics
from model.config import ModelConfig
from rehearsal.runs import debug_overrides
from support.data import data_config, global_batches
from support.launch import ROOT, python_or_torchrun, run, run_train, worker
from trainer.config import register
from trainer.preflight import validate_config

DEBUG = ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "configs/model/debug.yaml")))
LAYOUTS = {"1": (1, []), "dp_shard2": (2, ["dp_shard=2"]), "tp2": (2, ["tp=2"]),
           "dp_shard2_tp2": (4, ["dp_shard=2", "tp=2"])}
SHARE = {"1": 1.0, "dp_shard2": 0.5, "tp2": 0.5, "dp_shard2_tp2": 0.25}  # of the source's bytes, per rank


def hf_random_model(out: Path, cfg: ModelConfig = DEBUG, dtype=torch.float32, seed: int = 0,
                    max_shard_size: int | str = "50GB", **extra):
    """A transformers Llama of ``cfg``'s shape with every tensor random, saved with save_pretrained
    (``extra``: more LlamaConfig fields, e.g. rope_scaling; a ``max_shard_size`` below the model's
    size writes shards and model.safetensors.index.json, as every published 8B and 70B folder has)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden_dim, num_hidden_layers=cfg.n_layers,
                         num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                         vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_seq_len,
                         rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                         tie_word_embeddings=cfg.tie_embeddings, **extra)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.to(dtype).save_pretrained(out, max_shard_size=max_shard_size)
    return model.float().eval()


def folder_tensors(folder: Path) -> dict:
    """Every tensor of a Hugging Face folder, from model.safetensors or from each shard its index lists."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(folder / "model.safetensors")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return {name: t for shard in shards for name, t in load_file(folder / shard).items()}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "llama"
    model = hf_random_model(out)
    return out, model


def import_with(out: Path, source: Path, layout: str, *extra: str) -> dict:
    nproc, args = LAYOUTS[layout]
    cmd = python_or_torchrun(nproc, worker("init_from_worker"), str(out), str(source), *args, *extra)
    proc = run(cmd, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out)


def hf_logits(model, vocab: int) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(7))  # the worker's tokens
    with torch.no_grad():
        return model(tokens).logits


def assert_same_logits(got: torch.Tensor, ref: torch.Tensor) -> None:
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, rel
    assert torch.equal(got.argmax(-1), ref.argmax(-1)), "a different argmax somewhere"


def export_hf(checkpoint: Path, out: Path, *args: str) -> None:
    proc = run([sys.executable, str(ROOT / "scripts" / "export.py"), str(checkpoint), str(out), "--format", "hf",
                *args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_weights_give_hf_logits_at_every_layout_and_export_back_bitwise(layout, hf_folder, tmp_path):
    folder, model = hf_folder
    got = import_with(tmp_path / "out.pt", folder, layout, f"save={tmp_path / 'ckpt'}")
    assert_same_logits(got["logits"], hf_logits(model, DEBUG.vocab_size))
    header, _ = read_safetensors_header(folder / "model.safetensors")
    total = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
    # Each rank reads its share, plus at most one head of wq and wk rows per layer (a shard that starts
    # mid-head reads the whole head to reorder it) and the norms that tensor parallelism replicates.
    slack = 4 * DEBUG.n_layers * 2 * DEBUG.head_dim * DEBUG.dim + 4 * (2 * DEBUG.n_layers + 1) * DEBUG.dim
    for rank, read in enumerate(got["bytes_read"]):
        assert SHARE[layout] * total <= read <= SHARE[layout] * total + slack, (layout, rank, read, total)
    # import -> save (every rank its shards) -> export: HF's tensors, bit for bit
    export_hf(tmp_path / "ckpt" / "step_00000001", tmp_path / "again")
    original, again = load_file(folder / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert set(again) == set(original)
    for name, t in original.items():
        assert torch.equal(again[name], t), name


@pytest.mark.distributed
def test_bf16_folder_round_trips_bitwise(tmp_path):
    folder = tmp_path / "bf16"
    hf_random_model(folder, dtype=torch.bfloat16, seed=1)
    got = import_with(tmp_path / "out.pt", folder, "tp2", f"save={tmp_path / 'ckpt'}")
    original = load_file(folder / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in original.values())
    assert got["params"]["tok_embeddings.weight"].dtype == torch.float32  # fp32 master weights, exact upcasts
    export_hf(tmp_path / "ckpt" / "step_00000001", tmp_path / "again", "--dtype", "bf16")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert all(torch.equal(again[n], t) for n, t in original.items())


@pytest.mark.distributed
def test_checkpoint_and_safetensors_export_as_sources(hf_folder, tmp_path):
    """The two other kinds of source give the same weights, read at another layout than they were saved."""
    folder, model = hf_folder
    base = import_with(tmp_path / "base.pt", folder, "dp_shard2", f"save={tmp_path / 'ckpt'}")
    ckpt = tmp_path / "ckpt" / "step_00000001"
    from_ckpt = import_with(tmp_path / "ckpt.pt", ckpt, "tp2")
    proc = run([sys.executable, str(ROOT / "scripts" / "export.py"), str(ckpt), str(tmp_path / "w.safetensors")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    from_export = import_with(tmp_path / "export.pt", tmp_path / "w.safetensors", "1")
    for got in (from_ckpt, from_export):
        assert got["params"].keys() == base["params"].keys()
        for name, t in base["params"].items():
            assert torch.equal(got["params"][name], t), name
        assert_same_logits(got["logits"], hf_logits(model, DEBUG.vocab_size))


@pytest.mark.distributed
def test_tied_embeddings_import_at_one_process(tmp_path):
    cfg = ModelConfig(**{**vars(DEBUG), "tie_embeddings": True})
    model = hf_random_model(tmp_path / "tied", cfg, seed=2)
    got = import_with(tmp_path / "out.pt", tmp_path / "tied", "1", "model.tie_embeddings=true")
    assert_same_logits(got["logits"], hf_logits(model, DEBUG.vocab_size))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["dp_shard2", "tp2"])
def test_tied_embeddings_import_multi_process(layout, tmp_path):
    """A tied model (one parameter for the embedding and the output) imported at dp_shard 2 and tp 2."""
    cfg = ModelConfig(**{**vars(DEBUG), "tie_embeddings": True})
    model = hf_random_model(tmp_path / "tied", cfg, seed=2)
    nproc, args = LAYOUTS[layout]
    cmd = python_or_torchrun(nproc, worker("init_from_worker"), str(tmp_path / "out.pt"), str(tmp_path / "tied"),
                             *args, "model.tie_embeddings=true")
    proc = run(cmd, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert_same_logits(torch.load(tmp_path / "out.pt")["logits"], hf_logits(model, DEBUG.vocab_size))


@pytest.mark.distributed
def test_first_training_loss_is_hfs_loss_and_a_resume_ignores_init_from(hf_folder, pydoc_data, tmp_path):
    folder, model = hf_folder
    run_dir = tmp_path / "run"
    extra = {"model.init_from": str(folder), "checkpoint.interval": 2}
    proc = run_train(debug_overrides(run_dir, pydoc_data, steps=4, extra=extra))
    assert f"weights from model.init_from={folder} (hf, hash " in proc.stderr
    first = read_metrics(run_dir)[0]
    assert first["step"] == 1
    (_, inputs, targets), = global_batches(data_config(pydoc_data), dp=1, steps=1, global_batch=8, micro=4,
                                           seq_len=64, seed=1234)
    with torch.no_grad():
        logits = model(inputs).logits
    hf_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).item()
    assert abs(first["loss"] - hf_loss) <= 1e-5 * hf_loss, (first["loss"], hf_loss)
    manifest = json.loads((run_dir / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert manifest["init_from"]["kind"] == "hf" and manifest["init_from"]["path"] == str(folder.resolve())
    # A resumed run keeps its checkpoint's weights: init_from may even point nowhere now.
    extra = {"model.init_from": str(tmp_path / "gone"), "checkpoint.interval": 2}
    proc = run_train(debug_overrides(run_dir, pydoc_data, steps=6, extra=extra))
    assert "model.init_from ignored (resumed: the checkpoint's weights win)" in proc.stderr
    later = json.loads((run_dir / "checkpoints" / "step_00000006" / "manifest.json").read_text())
    assert later["init_from"] == manifest["init_from"]  # the weights' lineage is kept


def compose_cfg(*overrides):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_shape_mismatch_stops_at_start_up_naming_the_fields(hf_folder, pydoc_data, tmp_path):
    folder, _ = hf_folder
    cfg = compose_cfg("+experiment=debug", f"model.init_from={folder}", "model.n_layers=3", "model.dim=64",
                      f"data.path={pydoc_data}", f"output_root={tmp_path}")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, 1, files=True)
    assert f"model.n_layers=3 but {folder} has num_hidden_layers=2" in str(err.value)
    assert f"model.dim=64 but {folder} has hidden_size=128" in str(err.value)
    assert source_problems(DEBUG, folder) == []
    cfg = compose_cfg("+experiment=debug", f"model.init_from={tmp_path / 'nothing'}", f"data.path={pydoc_data}",
                      f"output_root={tmp_path}")
    with pytest.raises(ConfigError, match="nothing does not exist: give a Hugging Face Llama folder"):
        validate_config(cfg, 1, files=True)


def test_apply_init_from_restarts_the_ema_and_is_skipped_after_a_resume(hf_folder):
    from types import SimpleNamespace

    from checkpoint.interop.init_from import apply_init_from
    from model.llama import build_model
    from training.ema import EMA

    folder, hf = hf_folder
    model = build_model(DEBUG, seed=5)
    state = SimpleNamespace(model=model, ema=EMA(model, 0.9), step=0, weights_version=0)
    ckpt = SimpleNamespace(init_from=None)
    said = apply_init_from(str(folder), state, ckpt, "fresh start", torch.device("cpu"))
    assert said.startswith(f"fresh start; weights from model.init_from={folder} (hf, hash ")
    assert ckpt.init_from == {"path": str(folder.resolve()), "kind": "hf", "hash": said.split("hash ")[1][:-1],
                              "hf_config": json.loads((folder / "config.json").read_text()),  # for the export
                              "hf_generation_config": json.loads((folder / "generation_config.json").read_text())}
    embedding = hf.model.embed_tokens.weight
    assert torch.equal(model.tok_embeddings.weight, embedding)
    assert torch.equal(state.ema.shadow["tok_embeddings.weight"], embedding)  # the EMA starts from the import
    resumed = SimpleNamespace(model=build_model(DEBUG, seed=5), ema=None, step=3)
    before = resumed.model.tok_embeddings.weight.clone()
    said = apply_init_from(str(folder), resumed, SimpleNamespace(init_from=None), "from X", torch.device("cpu"))
    assert said == "from X; model.init_from ignored (resumed: the checkpoint's weights win)"
    assert torch.equal(resumed.model.tok_embeddings.weight, before)


def test_init_from_reads_again_as_recovery_read_retries_says(hf_folder, monkeypatch):
    """The storage fails every read of model.init_from (EIO): rank 0 reads again recovery.read_retries
    times, then the run stops with CheckpointUnreadable (the defaults, 3 retries from 2 s, were used
    whatever the config said)."""
    import errno
    from types import SimpleNamespace

    from checkpoint.durable.manifest import CheckpointUnreadable
    from checkpoint.interop import init_from, weight_source
    from checkpoint.interop.weight_source import SourceError
    from model.llama import build_model

    opened = []

    def failing(path):
        opened.append(path)
        raise SourceError(f"model.init_from={path}: unreadable") from OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(weight_source, "open_source", failing)
    state = SimpleNamespace(model=build_model(DEBUG, seed=5), ema=None, step=0, weights_version=0)
    folder, _ = hf_folder
    with pytest.raises(CheckpointUnreadable, match="could not be read after 1 retries"):
        init_from.apply_init_from(str(folder), state, SimpleNamespace(init_from=None), "fresh start",
                                  torch.device("cpu"), reads=(1, 0.0))
    assert len(opened) == 2  # opened once per try: no second open to check the shape
