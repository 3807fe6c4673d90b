"""Optimizer, learning-rate schedule and the optimizer step with gradient accumulation.

  optimizer.py  AdamW, decoupled weight decay on matrices only, fused where it can be
  schedule.py   warmup, then cosine (or constant)
  step.py       one optimizer step: accumulation, global-token loss normalisation, precision
  grad_stats.py the step's loss and per-layer gradient norms from one all-reduce (guards, clipping)
  ema.py        exponential moving average of the parameters
  evaluate.py   the validation loss, the same at every layout; the no-grad loss the probe shares
  config.py     the training, optim and eval sections
"""
