"""Autoregressive decoding with a KV cache: greedy, or sampled with temperature, top-k and top-p.

The prompt runs through the model once (filling the cache); every new token is then one
position's forward pass (model/kv_cache.py). ``temperature=0`` is greedy decoding, which is
deterministic; sampling draws from a ``torch.Generator`` the caller seeds, so a seed gives the
same text again on the same machine. Ids at or above ``vocab_limit`` (the embedding table's
padding beyond the tokenizer's vocabulary) are never produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from model.kv_cache import KVCache


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0: all
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches p; 1: all

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"--temperature {self.temperature} must be >= 0, --top-k {self.top_k} >= 0 and "
                             f"--top-p {self.top_p} in (0, 1]")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator] = None,
               vocab_limit: Optional[int] = None) -> int:
    """Choose the next id from one position's ``logits`` (vocab,)."""
    logits = logits.float().clone()
    if vocab_limit is not None:
        logits[vocab_limit:] = float("-inf")
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits /= sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # probability of the more likely tokens
        sorted_probs[before >= sampling.top_p] = 0.0  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: List[int], max_new_tokens: int, sampling: Sampling = Sampling(),
             generator: Optional[torch.Generator] = None, stop_id=None,
             vocab_limit: Optional[int] = None) -> List[int]:
    """The new ids after ``prompt`` (ending with ``stop_id`` if it was produced: one id, or several, as
    a Hugging Face config.json's eos_token_id list)."""
    stops = set(stop_id) if isinstance(stop_id, (list, tuple, set)) else {stop_id}
    cfg = model.cfg
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt) + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; with {max_new_tokens} new ones that is "
                         f"{len(prompt) + max_new_tokens} positions, above model.max_seq_len={cfg.max_seq_len}: "
                         f"ask for at most {max(cfg.max_seq_len - len(prompt), 0)} new tokens")
    was_training = model.training
    model.eval()
    weight = next(model.parameters())
    try:
        cache = KVCache(cfg, 1, len(prompt) + max_new_tokens, weight.device, weight.dtype)
        logits = model(torch.tensor([prompt], device=weight.device), cache=cache)[0, -1]
        out: List[int] = []
        for _ in range(max_new_tokens):
            token = next_token(logits, sampling, generator, vocab_limit)
            out.append(token)
            if token in stops or len(out) == max_new_tokens:
                break
            logits = model(torch.tensor([[token]], device=weight.device), cache=cache)[0, -1]
        return out
    finally:
        model.train(was_training)
