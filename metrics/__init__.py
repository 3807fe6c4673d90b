"""What a run reports: start-up banner, per-step lines, metrics.jsonl, wandb, TensorBoard."""
