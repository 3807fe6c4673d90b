"""Optimizer, learning-rate schedule and the optimizer step with gradient accumulation."""
