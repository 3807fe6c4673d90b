"""Recovery: detect failures within the configured timeouts, resume provably.

  watchdog.py    heartbeat per phase, stacks + JSON record, abort (the launcher restarts)
  faults.py      config-driven injection (sigkill, hang, exception, nan_loss, corrupt, disk_full, ...)
  resume.py      which checkpoint to resume from: memory tier first, then durable, with bounded fallback
  verify.py      post-load checks (step, LR, probe loss); refuses a directory whose checkpoints are all BAD
  probe.py       the probe loss: a fixed batch whose loss each checkpoint stores
  runtime.py     the few calls the run makes: preemption (SIGTERM/SIGUSR1 -> every rank saves at one step
                 boundary and exits 0), stragglers, the elastic batch log, checkpoint.interval=auto
  interval.py    Young/Daly checkpoint interval from measured costs and the cluster MTBF
  config.py      the recovery section
  fault_tolerance.py  replica groups under torchft (parallel.fault_tolerance): a lost group does not stop the
                 others, a restarted one takes the live state from a peer, the global batch is kept
  guards/        silent-corruption and loss-spike guards, rollback to a verified checkpoint
The rehearsal tooling (restart supervisor, kill-point chains) is in rehearsal/, the failure simulator in planner/.
"""
