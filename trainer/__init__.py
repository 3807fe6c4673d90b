"""The training run (run.py): composes model, parallel layout, data, checkpointing and recovery
from the config and runs the loop. train.py and the rehearsal tools call ``trainer.run.run``."""
