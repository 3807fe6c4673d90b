"""Per-rank activation memory of one micro-batch of model/llama.py, counted tensor by tensor (the
planner's activation term, planner/plan.py; beside the model because it follows its tensors).

What autograd keeps from forward to backward (b = micro batch, s = seq_len, d = dim, kv =
KV heads x head_dim, f = FFN width, h = heads, V = vocabulary, t = tp, A = bytes of the
compute dtype: 2 under bf16/fp16 autocast or bf16 FSDP2 parameters, 4 in fp32). Under tensor
parallel with sequence parallel, norms see s/t positions, heads and FFN columns are split t
ways, but the all-gathered input of each column-parallel matmul (wq/wk/wv, w1/w3, output) is
saved whole, as DTensor saves it.

Per block, no checkpointing:
  RMSNorm x 2       fp32 copies of x (8 B, two .float() calls; 4 B in fp32, where x itself
                    is saved), the normalised x (A), the all-gathered output (A, full s)
  attention         rotated q (A d), rotated k and v (2 A kv), SDPA output (A d),
                    log-sum-exp (4 B per head and position)
  SwiGLU            w1 x, silu(w1 x), w3 x, their product (4 A f)
Outside the blocks: token ids, the final norm, the logits (A V, held by the training step),
the fp32 log-softmax of cross entropy (4 V); with loss parallel both are split t ways.
Activation checkpointing (parallel/activations.py): ``full`` keeps each block's input;
``selective`` keeps the input and the outputs of every matmul and of SDPA (wo and w2
outputs are full b x s x d partial sums under TP) and, under TP, the reduce-scatters of the wo
and w2 outputs (so backward does not run them again); backward rebuilds one block at a time.
With fp32 parameters under autocast, the bf16 copies of every matmul weight are saved too.

tests/unit/test_activation_memory.py checks ``saved`` against the bytes autograd actually saves
(saved_tensors_hooks) and the storages still alive after forward, on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig
from model.counting import count_params

AC_MODES = ("none", "selective", "full")  # parallel.activation_checkpoint's choices (parallel/ is a layer above)


@dataclass(frozen=True)
class ActivationMemory:
    per_block: int  # what one block keeps until its backward
    outside_blocks: int  # token ids, final norm, logits, log-softmax
    weight_copies: int  # autocast's bf16 copies of fp32 matmul weights (0 with bf16 parameters)
    recompute: int  # one block rebuilt during backward (checkpointing), beyond what it kept
    loss_backward: int  # gradients of the log-softmax and logits at the start of backward
    n_layers: int

    @property
    def saved(self) -> int:
        """Held from the end of forward to the start of backward (what the test measures)."""
        return self.n_layers * self.per_block + self.outside_blocks + self.weight_copies

    @property
    def peak(self) -> int:
        """saved + the larger transient of backward (an estimate: not measured)."""
        return self.saved + max(self.recompute, self.loss_backward)


def _block_bytes(cfg: ModelConfig, b: int, s: int, tp: int, a: int, mode: str) -> int:
    d, kv, f, h = cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden_dim, cfg.n_heads
    s_local = s // tp  # sequence parallel: the residual stream and the norms
    fp32_x = 4 if a == 4 else 8  # the norm's .float() copies (x itself when already fp32)
    if mode == "full":
        return a * b * s_local * d
    if mode == "selective":
        return a * b * (s_local * d  # block input
                        + s * (d + 2 * kv) // tp  # wq, wk, wv outputs
                        + 2 * s * d  # wo and w2 outputs (full-sequence partial sums under TP)
                        + (2 * s_local * d if tp > 1 else 0)  # and their reduce-scatters (sequence parallel)
                        + 2 * s * f // tp  # w1, w3 outputs
                        + s * d // tp) + 4 * b * h // tp * s  # SDPA output and log-sum-exp
    norms = 2 * ((fp32_x + a) * b * s_local * d + 4 * b * s_local + a * b * s * d)  # + rsqrt, gathered output
    attention = a * b * s * (2 * d + 2 * kv) // tp + 4 * b * h // tp * s
    swiglu = 4 * a * b * s * f // tp
    return norms + attention + swiglu


def activation_memory(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1, mode: str = "none",
                      compute_bytes: int = 2, loss_parallel: bool = False,
                      fp32_params_under_autocast: bool = False) -> ActivationMemory:
    """Bytes per rank for one micro-batch (the others reuse the memory after their backward)."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing {mode!r}: choose one of {list(AC_MODES)}")
    b, s, d, a = micro_batch, seq_len, cfg.dim, compute_bytes
    vocab = cfg.vocab_size // tp if loss_parallel else cfg.vocab_size
    fp32_x = 4 if a == 4 else 8
    final_norm = (fp32_x + a) * b * (s // tp) * d + 4 * b * (s // tp) + a * b * s * d
    outside = 8 * b * s + final_norm + (a + 4) * b * s * vocab + 8 * b * s  # ids, norm, logits + log-softmax, targets
    copies = 2 * count_params(cfg).matmul // tp if fp32_params_under_autocast and a == 2 else 0
    block = _block_bytes(cfg, b, s, tp, a, mode)
    recompute = 0 if mode == "none" else _block_bytes(cfg, b, s, tp, a, "none") - block
    return ActivationMemory(per_block=block, outside_blocks=outside, weight_copies=copies, recompute=recompute,
                            loss_backward=(8 + a) * b * s * vocab, n_layers=cfg.n_layers)
