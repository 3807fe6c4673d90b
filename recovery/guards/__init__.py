"""Guards against silent data corruption and loss spikes (see guard.py for the actions)."""

from recovery.guards.guard import ACTIONS, RollbackRequested, TrainingGuards

__all__ = ["ACTIONS", "RollbackRequested", "TrainingGuards"]
