"""The rotary permutation between Meta's and Hugging Face's layout of wq and wk rows.

Within each head of ``head_dim`` rows, model/llama.py rotates consecutive pairs: rows (2j, 2j+1)
share frequency j. Hugging Face's Llama rotates halves: rows (j, j + head_dim/2) share it. The
same weights in HF's layout are therefore the rows of each head reordered

  Meta row 2j + p  ->  HF row p * head_dim/2 + j        (p in {0, 1}, j < head_dim/2)

which is the ``permute`` of transformers' convert_llama_weights_to_hf.py. Both directions are
a reshape and a transpose per head, so a slice of whole heads converts on its own: the import
reads only the heads a rank holds (checkpoint/interop/safetensors_io.py).
"""

from __future__ import annotations

import torch


def to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta's row order -> Hugging Face's, for ``w`` holding ``heads`` whole heads (rows first)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def from_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's row order -> Meta's (the inverse of ``to_hf_rows``)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(w.shape)
