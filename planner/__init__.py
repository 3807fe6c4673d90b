"""Estimates made before a run, which a run never imports (scripts/plan.py and
scripts/plan_checkpointing.py print them). The model's own numbers come from model/ (parameters, FLOPs and
tensor-parallel collectives: counting.py; activation bytes: activation_memory.py).

  plan.py               memory per rank, step time, MFU and checkpoint costs of a layout
  comm_model.py         communication per step and rank, and the step time it leaves
  simulate.py           Monte Carlo of failures: the effective training-time ratio at scale
"""
