"""Checkpointing: the full training state, saved durably and in memory, loaded at any layout.

Five parts, one folder each (docs/checkpoint-format.md has the format and the protocol):
  state/     what a checkpoint holds: TrainingState, RNG, the config fingerprint, host staging
  storage/   where it is stored, behind one small interface: a file system, S3
  durable/   the durable tier: DCP saves (sync, async), raw-bytes data files, the commit
             protocol, the attempt lease, save errors, manifest, pre-flight, retention,
             discovery, the verified and resharding load
  memory/    the memory tier: node-local snapshots with a peer replica, and their restore
  interop/   weights in and out: safetensors and Hugging Face exports, model.init_from, stock DCP
Beside them, what the trainer uses:
  manager.py        the facade: preflight, load, save when due, close
  save_manifest.py  the manifest of a save (probe loss, config hash, validation loss, init_from)
  events.py         what the tiers report: log lines and metrics.jsonl records
  checks.py         the checkpoint section's config checks and its file probes
Which checkpoint a run resumes from, and the fallback when one fails, are recovery's
(recovery/resume.py); the probe is recovery/probe.py.
"""

import warnings

# DCP warns on every single-process save/load that it "assumes the intent"; that intent is ours.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
