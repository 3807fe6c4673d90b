"""Hydra configs (YAML groups, experiments) and how a key is declared (keys.py: type, default, bound,
meaning; the sections themselves are each package's config.py, composed by trainer/config.py)."""
