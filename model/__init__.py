"""Llama-style decoder (llama.py), its presets' shape (config.py), parameter and FLOP counters
(counting.py). Import from the modules: config.py and counting.py do not import torch, so
config checks stay torch-free."""
