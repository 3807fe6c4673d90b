"""One training run, and what is decided before it starts.

  run.py                the recipe: composes model, parallel layout, data, checkpointing and recovery
                        from the config and runs the loop (train.py and tools/supervisor.py call it)
  checks.py             every config check gathered into one block (each package checks its section)
  startup.py            the launch's checks, decided on rank 0 and agreed by every rank, and the
                        attempt lease taken, before anything is built or written
  plan.py               the layout planner: memory per rank, step time, MFU (scripts/plan.py)
  comm_model.py         the planner's communication per step and rank, and the step time it leaves
  activation_memory.py  activation bytes per rank for a layout and recipe (the planner's input)
"""
