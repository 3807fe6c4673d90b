"""One training run, and what is decided before it starts.

  run.py       the recipe: composes model, parallel layout, data, checkpointing and recovery
               from the config and runs the loop (train.py and rehearsal/supervisor.py call it)
  checks.py    every config check gathered into one block (each package checks its section)
  startup.py   the launch's checks, decided on rank 0 and agreed by every rank, and the
               attempt lease taken, before anything is built or written
"""
