"""Checkpointing: full training state, DCP save/load, commit protocol, retention."""
