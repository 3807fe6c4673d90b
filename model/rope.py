"""Rotary frequencies: plain RoPE, and the rotary scaling Llama 3.1+ publishes (``rope_type: llama3``).

Llama 3.1, 3.2 and 3.3 were trained with 8192 positions and then extended: their config.json has
``rope_scaling = {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
original_max_position_embeddings}``. Frequencies whose wavelength is longer than
original / low_freq_factor positions are divided by ``factor``, those shorter than original /
high_freq_factor are kept, and the band between is interpolated linearly in original /
wavelength. The cos/sin tables are not rescaled (attention factor 1). This is Meta's
``apply_scaling`` and transformers' ``_compute_llama3_parameters``, step for step in fp32, so
the tables are bitwise theirs (tests/integration/test_llama3_rope.py).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from model.config import LLAMA3_ROPE_KEYS


def inv_frequencies(head_dim: int, theta: float, scaling: Optional[Dict] = None, device=None) -> torch.Tensor:
    """The head_dim // 2 inverse frequencies 1 / theta^(2j / head_dim), scaled by ``scaling`` (fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    if not scaling:
        return inv_freq
    factor, low, high, original = (float(scaling[k]) for k in LLAMA3_ROPE_KEYS)
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None, scaling: Optional[Dict] = None):
    """cos and sin tables of shape (max_seq_len, head_dim // 2), in fp32."""
    inv_freq = inv_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()
