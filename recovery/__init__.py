"""Recovery: watchdog, fault injection, verified resume, elastic restarts."""
