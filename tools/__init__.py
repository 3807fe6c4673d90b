"""Rehearsal and simulation tooling: nothing a training run imports.

supervisor   fast restart loop: forks training runs (trainer.run) from a warm parent
rehearsal    seeded kill-point chains and their checks (tests, scripts/rehearse.py)
runs         the small debug-run overrides that tests, rehearsals and benchmarks share
simulate     Monte Carlo of failures: effective training-time ratio at scale
"""
