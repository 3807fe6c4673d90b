"""Text generation: the KV cache gives the full forward's logits, greedy decoding with it equals
step-by-step argmax over the whole sequence, sampling follows its rules, and scripts/generate.py
reads a tensor-parallel checkpoint and its export alike."""

from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
import torch

from checkpoint.durable.discovery import list_committed
from model.config import ModelConfig
from model.generation import Sampling, generate, next_token
from model.kv_cache import KVCache
from model.llama import build_model
from rehearsal.runs import debug_overrides
from support.launch import ROOT, load_script, run, run_train

GQA = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=64)


def test_the_cache_gives_the_full_forward_logits():
    model = build_model(GQA, seed=1).eval()
    tokens = torch.randint(0, GQA.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(GQA, 2, 40, "cpu")
        parts = [model(tokens[:, :17], cache=cache)]  # a prompt, then one token at a time, then a chunk
        parts += [model(tokens[:, i:i + 1], cache=cache) for i in range(17, 30)]
        parts.append(model(tokens[:, 30:], cache=cache))
    assert cache.pos == 40
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="the KV cache holds 40 positions; 40 are filled and 1 more do not fit"):
        model(tokens[:, :1], cache=cache)


@pytest.fixture(scope="module")
def tp_checkpoint(pydoc_data, tmp_path_factory):
    """A checkpoint written by 2 tensor-parallel ranks after 40 steps of the debug experiment."""
    run_dir = tmp_path_factory.mktemp("generate") / "tp2"
    run_train(debug_overrides(run_dir, pydoc_data, steps=40, extra={
        "parallel.tp": 2, "checkpoint.interval": 40, "training.global_batch_size": 16, "training.micro_batch_size": 8,
        "training.seq_len": 128}), nproc=2)
    [ckpt] = list_committed(run_dir / "checkpoints")
    assert ckpt.manifest.layout["tp"] == 2
    return ckpt.path


def full_sequence_argmax(model, prompt, n, vocab_limit):
    """The reference: run the whole sequence through the model for every new token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]))[0, -1].clone()
            logits[vocab_limit:] = float("-inf")
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


@pytest.mark.distributed  # the fixture trains with torchrun
def test_greedy_decoding_with_the_cache_equals_full_sequence_argmax(tp_checkpoint, pydoc_data):
    from data.formats.native import load_tokenizer

    generate_script = load_script("generate")
    loaded = generate_script.load(tp_checkpoint)
    tok = load_tokenizer(pydoc_data)
    prompt = tok.encode("The import statement")
    greedy = generate(loaded.model, prompt, 100, Sampling(temperature=0.0), vocab_limit=tok.vocab_size)
    assert len(greedy) == 100  # no EOS in the way: the comparison covers every token
    assert greedy == full_sequence_argmax(loaded.model, prompt, 100, tok.vocab_size)
    assert generate(loaded.model, prompt, 100, Sampling(), vocab_limit=tok.vocab_size) == greedy  # deterministic


def script(*args) -> str:
    proc = run([sys.executable, str(ROOT / "scripts" / "generate.py"), *map(str, args)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.distributed  # the fixture trains with torchrun
def test_the_script_reads_a_tensor_parallel_checkpoint_and_its_export(tp_checkpoint, pydoc_data, tmp_path):
    greedy = script(tp_checkpoint, "--prompt", "Lists", "--temperature", 0, "--max-new-tokens", 80)
    assert greedy.startswith("Lists") and len(greedy) > 40
    export = tmp_path / "model.safetensors"
    proc = run([sys.executable, str(ROOT / "scripts" / "export.py"), str(tp_checkpoint), str(export)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert script(export, "--data", pydoc_data, "--prompt", "Lists", "--temperature", 0,
                  "--max-new-tokens", 80) == greedy
    sampled = [script(tp_checkpoint, "--prompt", "Lists", "--seed", seed, "--max-new-tokens", 80) for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]  # a seed gives the same text again


def test_sampling_rules():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, 9.0])
    assert next_token(logits, Sampling(temperature=0.0)) == 4
    assert next_token(logits, Sampling(temperature=0.0), vocab_limit=4) == 0  # padding ids are never produced
    gen = torch.Generator().manual_seed(0)
    assert {next_token(logits, Sampling(temperature=5.0, top_k=1), gen, vocab_limit=4) for _ in range(50)} == {0}
    assert {next_token(logits, Sampling(temperature=5.0, top_k=2), gen, vocab_limit=4) for _ in range(200)} == {0, 1}
    probs = torch.tensor([0.6, 0.3, 0.1]).log()
    assert {next_token(probs, Sampling(temperature=1.0, top_p=0.5), gen) for _ in range(100)} == {0}
    assert {next_token(probs, Sampling(temperature=1.0, top_p=0.7), gen) for _ in range(200)} == {0, 1}
    draws = [next_token(torch.tensor([0.0, math.log(3.0)]), Sampling(temperature=1.0), gen) for _ in range(4000)]
    assert abs(sum(draws) / len(draws) - 0.75) < 0.03  # p(1) = 3 / (1 + 3)
    with pytest.raises(ValueError, match=r"--top-p 0 in \(0, 1\]"):
        Sampling(temperature=1.0, top_p=0)


def test_inputs_that_cannot_work_are_named(tmp_path, pydoc_data):
    model = build_model(GQA, seed=1)
    with pytest.raises(ValueError, match="the prompt has 10 tokens; with 60 new ones that is 70 positions, above "
                                         "model.max_seq_len=64: ask for at most 54 new tokens"):
        generate(model, list(range(10)), 60)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    proc = run([sys.executable, str(ROOT / "scripts" / "generate.py"), str(hf), "--prompt", "x"])
    assert proc.returncode == 2
    assert "a Hugging Face folder needs model.safetensors or model.safetensors.index.json" in proc.stderr


def byte_llama_folder(folder, seed: int) -> None:
    """A transformers Llama with llama3 rotary scaling saved in shards (model.safetensors.index.json, as
    published folders are), eos_token_id [256, 7], and the byte tokenizer's tokenizer.json with BOS 257
    put before the text by its post-processor, as Llama 3's does."""
    from test_interop_import import hf_random_model
    from test_llama3_rope import SCALED, SCALING
    from tokenizers import processors

    from data.tokenizer import byte_tokenizer_json

    bos = "<|begin_of_text|>"
    cfg = ModelConfig(**{**vars(SCALED), "vocab_size": 258})  # the tokenizer's ids: argmax over the same set
    hf_random_model(folder, cfg, seed=seed, max_shard_size="400KB", rope_scaling=dict(SCALING), eos_token_id=[256, 7],
                    bos_token_id=257)
    tok = byte_tokenizer_json()
    tok.add_special_tokens([bos])
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 257)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|endoftext|>"}))


@pytest.mark.distributed  # a script process
def test_the_script_on_a_hf_folder_equals_transformers_greedy_generate(tmp_path):
    """A transformers Llama with llama3 rotary scaling, saved in shards with model.safetensors.index.json (as
    published 8B and 70B folders are), and a tokenizer.json that puts a BOS before the text as Llama 3's
    does (the byte tokenizer's ids, EOS 256, BOS 257 added by its post-processor; eos_token_id [256, 7] in
    config.json): scripts/generate.py --temperature 0 prints what transformers' generate(do_sample=False)
    gives on the same folder from the ids AutoTokenizer gives, decoded by the same tokenizer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = tmp_path / "hf"
    byte_llama_folder(folder, seed=6)
    assert (folder / "model.safetensors.index.json").is_file()
    prompt, new = "The rotary embedding of Llama 3.1", 60  # 1 + 33 + 60 positions: past the original 32
    reference = AutoTokenizer.from_pretrained(folder)
    ids = reference(prompt, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 257 and ids.shape[1] == 1 + len(prompt)  # BOS, then a byte each
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=256)[0].tolist()
    proc = run([sys.executable, str(ROOT / "scripts" / "generate.py"), str(folder), "--prompt", prompt,
                "--temperature", "0", "--max-new-tokens", str(new)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(out) > ids.shape[1] + 10  # it generated, not stopped at once
    assert proc.stdout.rstrip("\n") == reference.decode(out, skip_special_tokens=True,
                                                         clean_up_tokenization_spaces=False)


PROMPT, NEW = "The rotary embedding of Llama 3.1", 60


@pytest.fixture(scope="module")
def stopping_folder(tmp_path_factory):
    """A Hugging Face folder as test_the_script_on_a_hf_folder_equals_transformers_greedy_generate builds it,
    whose generation_config.json lists one end-of-text id more than config.json (as instruct models do):
    an id its greedy continuation reaches at the 9th token or later, so that transformers stops there.
    Returns the folder and what transformers' generate(do_sample=False) gives on it, decoded."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("stopping") / "hf"
    byte_llama_folder(folder, seed=7)  # seed 7: a continuation of 13 different ids in 60 (seed 6's repeats one)
    reference = AutoTokenizer.from_pretrained(folder)
    ids = reference(PROMPT, return_tensors="pt").input_ids
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        free = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=256)[0, ids.shape[1]:].tolist()
    stop = next(t for k, t in enumerate(free) if k >= 8 and t not in free[:k] and t not in (256, 7, 257))
    GenerationConfig(bos_token_id=257, eos_token_id=[256, 7, stop], do_sample=False).save_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # reads generation_config.json
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=256)[0].tolist()
    assert out[-1] == stop and ids.shape[1] + 8 < len(out) < ids.shape[1] + NEW  # stopped there, not at once
    return folder, reference.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def greedy(model) -> str:
    return script(model, "--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", NEW).rstrip("\n")


@pytest.mark.distributed  # script processes
def test_a_converted_folder_generates_what_the_folder_generates_with_no_flag(stopping_folder, tmp_path):
    """scripts/convert_checkpoint.py HF DST --to raw keeps the folder's tokenizer.json and tokenizer_config.json
    (listed and checksummed in DST's manifest) and its generation_config.json (the manifest's init_from record):
    scripts/generate.py DST needs no flag, and once the folder is gone it prints what it printed on the folder,
    which is transformers' greedy generate, stopped at the id only generation_config.json lists. The --to dcp
    conversion of DST, and DST exported back, keep the tokenizer too."""
    from checkpoint.durable.manifest import verify_checkpoint

    src, want = stopping_folder
    folder = tmp_path / "hf"
    shutil.copytree(src, folder)
    assert greedy(folder) == want
    proc = run([sys.executable, str(ROOT / "scripts" / "convert_checkpoint.py"), str(folder), str(tmp_path / "ckpt"),
                "--to", "raw"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "its tokenizer.json and tokenizer_config.json kept" in proc.stdout
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(verify_checkpoint(tmp_path / "ckpt").files)
    shutil.rmtree(folder)  # a copy, not a reference: the folder may be moved or deleted once converted
    assert greedy(tmp_path / "ckpt") == want
    from checkpoint.interop.convert import convert_to_dcp
    from checkpoint.interop.export import export_hf

    convert_to_dcp(tmp_path / "ckpt", tmp_path / "dcp")
    assert greedy(tmp_path / "dcp") == want
    info = export_hf(tmp_path / "dcp", tmp_path / "again")
    assert info["tokenizer"] == f"hf tokenizer kept in {tmp_path / 'dcp'}"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (src / name).read_bytes(), name
    assert greedy(tmp_path / "again") == want  # its generation_config.json stops where the folder's did


@pytest.mark.distributed  # trains with train.py
def test_a_run_from_the_folder_generates_what_the_folder_generates(stopping_folder, tmp_path):
    """A run from model.init_from=HF on data prepared with the folder's tokenizer (hf:HF/tokenizer.json), at a
    learning rate of 1e-30 so that its weights stay the folder's bit for bit: scripts/generate.py on its
    checkpoint needs no flag (the data's tokenizer) and prints what the folder gives, stopped where the folder's
    generation_config.json says (the manifest's init_from record keeps it)."""
    from checkpoint.interop.export import load_tensors
    from data.prep.writer import prepare_token_file

    src, want = stopping_folder
    data = tmp_path / "data"
    prepare_token_file(data, ["pydoc"], f"hf:{src / 'tokenizer.json'}")
    run_dir = tmp_path / "run"
    run_train(debug_overrides(run_dir, data, steps=2, extra={
        "model": "hf", "model.init_from": str(src), "data.tokenizer": f"hf:{src / 'tokenizer.json'}",
        "data.validation": "none", "optim.lr": 1e-30, "optim.lr_min": 0, "checkpoint.interval": 2}))
    [ckpt] = list_committed(run_dir / "checkpoints")
    from checkpoint.interop.from_hf import folder_model_config, hf_tensors

    cfg = folder_model_config(src)
    trained = load_tensors(ckpt.path)
    assert all(torch.equal(trained[name], t) for name, t in hf_tensors(src, cfg, list(trained)))  # unchanged
    assert greedy(ckpt.path) == want
