"""Recovery: detect failures within the configured timeouts, resume provably, rehearse it all.

  watchdog.py    heartbeat per phase, stacks + JSON record, abort (the launcher restarts)
  stragglers.py  per-rank step times gathered every N steps; the slow rank is named
  preemption.py  SIGTERM/SIGUSR1 -> all ranks save at the same step boundary and exit 0
  faults.py      config-driven injection (sigkill, hang, exception, nan_loss, corrupt, disk_full, ...)
  resume.py      which checkpoint to resume from: memory tier first, then durable, with bounded fallback
  verify.py      post-load checks (step, LR, probe loss); refuses a directory whose checkpoints are all BAD
  probe.py       the probe loss: a fixed batch whose loss each checkpoint stores
  runtime.py     the few calls the run makes; elastic batch log; checkpoint.interval=auto
  interval.py    Young/Daly checkpoint interval from measured costs and the cluster MTBF
  checks.py      the recovery section's config checks
  guards/        silent-corruption and loss-spike guards, rollback to a verified checkpoint
The rehearsal tooling (restart supervisor, kill-point chains, failure simulator) is in tools/.
"""
