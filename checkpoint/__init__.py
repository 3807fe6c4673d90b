"""Checkpointing: full training state, DCP save/load, commit protocol, retention."""

import warnings

# DCP warns on every single-process save/load that it "assumes the intent"; that intent is ours.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
