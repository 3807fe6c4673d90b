"""The guards' sub-section (``recovery.guards.*``): silent-corruption and loss-spike checks (torch-free;
recovery/guards/guard.py explains the actions)."""

from __future__ import annotations

from dataclasses import dataclass

from configs.keys import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Bound, key

ACTIONS = ("log", "skip_step", "block_verified", "rollback")
WINDOW = Bound(3, why="a median needs a few values")


@dataclass
class GuardsConfig:
    enabled: bool = key(True, "run the guards")
    action: str = key("skip_step", "what an alarm does (recovery/guards/guard.py)", choices=ACTIONS)
    warmup_steps: int = key(20, "no gradient or loss alarm before this many healthy steps", NON_NEGATIVE)
    grad_norm_multiple: float = key(100.0, "a layer's grad norm above this x its running mean alarms (docs/guards.md)",
                                    Bound(1, open_low=True))
    loss_spike_k: float = key(6.0, "loss above median + k x 1.4826 x MAD of the window alarms ...", POSITIVE)
    loss_spike_rel: float = key(0.5, "... and above median x (1 + rel)", POSITIVE)
    loss_window: int = key(50, "steps of the loss window", WINDOW)
    shadow_interval: int = key(50, "steps between fixed-batch (probe) forward passes; 0 disables", NON_NEGATIVE)
    shadow_rel: float = key(0.25, "a shadow loss above its recent median x (1 + rel) alarms", POSITIVE)
    shadow_window: int = key(8, "shadow losses in the median", WINDOW)
    replica_interval: int = key(100, "steps between cross-replica weight fingerprints (dp_replicate > 1)",
                                NON_NEGATIVE)
    max_consecutive_skips: int = key(3, "then skip_step escalates to rollback", AT_LEAST_1)
    max_rollbacks: int = key(3, "per process; then stop with an error rather than loop", AT_LEAST_1)
    rollback_min_age_steps: int = key(0, "roll back to a verified checkpoint at least this much older ...",
                                      NON_NEGATIVE)
    rollback_prefer_permanent: bool = key(True, "... preferring the permanent (keep_every) tier past that age")
