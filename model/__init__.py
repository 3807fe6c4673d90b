"""Llama-style decoder and its arithmetic.

  llama.py       the decoder (RMSNorm, RoPE, GQA, SwiGLU)
  rope.py        rotary frequencies: plain, and Llama 3.1's scaling (rope_type llama3)
  config.py      its shape (torch-free), and model_config(): the ModelConfig of a composed config
  counting.py    parameter and FLOP counts from the config alone (torch-free)
  init.py        initial values as a pure function of (seed, name, position)
  generation.py, kv_cache.py   decoding with a KV cache
Import from the modules: config.py and counting.py do not import torch, so config checks stay torch-free.
"""
