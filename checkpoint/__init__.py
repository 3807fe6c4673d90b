"""Checkpointing: the full training state, saved durably and in memory, loaded at any layout.

Five parts, one folder each (docs/checkpoint-format.md has the format and the protocol):
  state/     what a checkpoint holds: TrainingState, RNG, the config fingerprint
  storage/   where it is stored, behind one small interface: a file system, S3
  durable/   the durable tier: DCP saves (sync, async), raw-bytes data files, the commit
             protocol, the attempt lease, save errors, manifest, pre-flight, retention,
             discovery, the verified and resharding load
  memory/    the memory tier: node-local snapshots with a peer replica, and their restore
  interop/   weights in and out: safetensors and Hugging Face exports, model.init_from, stock DCP
Beside them, what the trainer uses:
  manager.py  the facade: preflight, load, save when due, close; each save's manifest and report
  checks.py   the checkpoint section's file probes (pre-flight), torch-free
Which checkpoint a run resumes from, and the fallback when one fails, are recovery's
(recovery/resume.py); the probe is recovery/probe.py.
"""

import warnings

# DCP warns on every single-process save/load that it "assumes the intent"; that intent is ours.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
