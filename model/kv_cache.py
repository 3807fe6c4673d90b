"""Keys and values of the positions already processed, for decoding one token at a time.

Without a cache, generating token t runs the model over all t positions again; with it, each
new token costs one position's forward pass: every attention layer appends the new keys and
values (after RoPE) to its slice of the cache and attends over everything cached so far.
Inference only (scripts/generate.py): training never passes a cache, and the model then runs
exactly the code it ran before the cache existed.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from model.config import ModelConfig


class LayerCache:
    """One attention layer's view of the cache: ``extend`` is called once per forward pass."""

    def __init__(self, cache: "KVCache", layer: int):
        self.cache, self.layer = cache, layer

    def extend(self, k: torch.Tensor, v: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Store ``k``, ``v`` (batch, kv_heads, new, head_dim) after the cached positions; return
        the keys and values of every position so far and the attention mask of the new queries
        (True: may attend), or None when each new query may attend to everything (one new token)."""
        c = self.cache
        start, new = c.pos, k.shape[2]
        c.k[self.layer, :, :, start:start + new] = k
        c.v[self.layer, :, :, start:start + new] = v
        keys, values = c.k[self.layer, :, :, :start + new], c.v[self.layer, :, :, :start + new]
        if new == 1:
            return keys, values, None
        # Query i sits at position start + i: it sees the cached prefix and the new tokens up to itself.
        mask = torch.ones(new, start + new, dtype=torch.bool, device=k.device).tril(diagonal=start)
        return keys, values, mask


class KVCache:
    """Per-layer keys and values for ``batch`` sequences of up to ``max_len`` positions."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype = torch.float32):
        if not 0 < max_len <= cfg.max_seq_len:
            raise ValueError(f"a KV cache of {max_len} positions: must be in [1, model.max_seq_len="
                             f"{cfg.max_seq_len}]")
        shape = (cfg.n_layers, batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.pos = 0  # positions filled: the next token's position

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def check_room(self, new: int) -> None:
        if self.pos + new > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {self.pos} are filled and "
                             f"{new} more do not fit")

    def advance(self, new: int) -> None:
        """Called by the model after all layers stored ``new`` positions."""
        self.pos += new
