"""What a run reports: start-up banner, per-step lines, metrics.jsonl, wandb, TensorBoard.

  logger.py      log lines, metrics.jsonl (rank 0), wandb and TensorBoard
  throughput.py  model FLOPs utilisation
  records.py     reading metrics.jsonl back (tools, scripts, tests)
  plots.py       curves of one or more runs as a PNG
  run_dir.py     the run directory, stable across restarts
  config.py      the logging section
"""
