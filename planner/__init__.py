"""Estimates made before a run, which a run never imports (scripts/plan.py and
scripts/plan_checkpointing.py print them).

  plan.py               memory per rank, step time, MFU and checkpoint costs of a layout
  comm_model.py         communication per step and rank, and the step time it leaves
  activation_memory.py  activation bytes per rank for a layout and recipe
  simulate.py           Monte Carlo of failures: the effective training-time ratio at scale
"""
