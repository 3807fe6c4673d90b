"""Guards against silent data corruption and loss spikes: config.py (the section), guard.py (the detectors,
the replica fingerprint, the alarms and the actions), rollback.py (to a verified checkpoint)."""
