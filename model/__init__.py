"""Llama-style decoder, its presets' shape, and parameter / FLOP counters."""

from model.config import ModelConfig, ffn_hidden_dim
from model.counting import count_params, flops_per_token
from model.llama import Transformer, build_model, materialize_model

__all__ = ["ModelConfig", "Transformer", "build_model", "materialize_model", "count_params",
           "flops_per_token", "ffn_hidden_dim"]
