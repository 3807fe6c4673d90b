"""Hydra configs (YAML groups) and their schema (schema.py)."""
