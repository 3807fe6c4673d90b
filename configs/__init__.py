"""Hydra configs (YAML groups, experiments) and what every layer may import about them.

  schema.py     the typed schema: a misspelled key or a wrong type fails at compose time
  constants.py  torch-free vocabulary: valid choices, default timeouts, IGNORE_INDEX
  checks.py     ConfigError and Problems, which each package's checks.py fills (trainer/checks.py)
"""
