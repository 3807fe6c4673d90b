"""What a checkpoint holds.

  training_state.py  TrainingState: the one Stateful holding everything that changes the trajectory;
                     per-rank RNG capture and restore, the reseed policy for a changed world size
  fingerprint.py     the config hash, and the fields a resume may change
"""
