"""Llama-style decoder and its arithmetic.

  llama.py       the decoder (RMSNorm, RoPE, GQA, SwiGLU)
  rope.py        rotary frequencies: plain, and Llama 3.1's scaling (rope_type llama3)
  config.py      its shape (torch-free), and model_config(): the ModelConfig of a composed config
  counting.py    parameter and FLOP counts, the TP plan's collectives, from the config alone (torch-free)
  activation_memory.py   activation bytes of one micro-batch, for the planner (torch-free)
  parallelize.py the parallel plan: tensor-parallel styles per module, FSDP2 units, the blocks
  hf.py          the Hugging Face adapter: names, q/k row order, config.json, shape checks (torch-free)
  init.py        initial values as a pure function of (seed, name, position)
  generation.py, kv_cache.py   decoding with a KV cache
The model's module names appear in this folder only (tests/unit/test_model_names.py). Import from the modules:
config.py, counting.py, activation_memory.py and hf.py do not import torch, so config checks stay torch-free.
"""
