"""Guards against silent data corruption and loss spikes: config.py (the section), guard.py (the checks and
the actions), detectors.py, replica.py, alarms.py, rollback.py (to a verified checkpoint)."""
