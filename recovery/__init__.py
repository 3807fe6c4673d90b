"""Recovery: detect failures in seconds, resume provably, rehearse it all.

watchdog     heartbeat per phase, stacks + JSON record, abort (the launcher restarts)
stragglers   per-rank step times gathered every N steps; the slow rank is named
preemption   SIGTERM/SIGUSR1 -> all ranks save at the same step boundary and exit 0
faults       config-driven injection (sigkill, hang, exception, nan_loss, corrupt)
corrupt      the storage failures a checkpoint must survive (truncate, flip, delete)
verify       post-load checks (step, LR, probe loss) and bounded fallback
runtime      the few calls train.py makes; elastic batch log; checkpoint.interval=auto
interval     Young/Daly checkpoint interval from measured costs and the cluster MTBF
simulate     Monte Carlo of failures: effective training-time ratio at scale
supervisor   fast restart loop (fork from a warm parent) for rehearsals and tests
rehearsal    seeded kill-point chains and their checks (tests, scripts/rehearse.py)
"""
