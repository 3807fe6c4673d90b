"""One training run, and what is decided before it starts.

  config.py     the run's config: every package's section composed into one typed tree, and what several
                sections cannot be together (torch-free)
  preflight.py  the launch's checks (files, folders, device; under torchrun read on rank 0 and agreed by
                every rank) and the attempt lease, before anything is built or written
  run.py        the recipe: composes model, parallel layout, data, checkpointing and recovery from the
                checked config and runs the loop (train.py and rehearsal/supervisor.py call it)
"""
