"""The rehearsal kit: what exercises the trainer from outside, for tests, benchmarks and a fork's CI.
Nothing a training run imports (tests/unit/test_layout.py checks it).

  supervisor   the restart loop: forks training runs (trainer.run) from a warm parent
  chains       seeded kill-point chains and their checks (tests, scripts/rehearse.py)
  runs         the small debug-run overrides that tests, rehearsals and benchmarks share
  processes    a free port, a child's environment, the kill of a process tree (tests, scripts, s3_server)
  bench        what the benchmarks in scripts/ share: runs in turns, the floors, ratios with their verdict
  s3_server    a local S3 server (moto, on 127.0.0.1) for tests and benchmarks of s3:// checkpoints
"""
