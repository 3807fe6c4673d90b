"""Checkpointing: full training state, DCP save/load, commit protocol, retention.

Module map (docs/checkpoint-format.md has the format and the protocol):
  state.py       TrainingState: the one Stateful holding everything that changes the trajectory
  rng.py         per-rank RNG capture/restore; reseed policy for a changed world size
  staging.py     reusable host staging buffers for async saves (pinned on CUDA)
  saver.py       sync / async saves (dedicated gloo group), phases with fault hooks
  storage.py     data files: raw tensor bytes read straight into the destination, checksums on the fly
  commit.py      acknowledge -> collect -> seal -> commit rename -> latest pointer
  lease.py       which attempt owns checkpoint.dir: an older attempt's writer never commits
  save_errors.py a save the storage refused (disk full, read-only, quota): the message, the numbers
  manifest.py    manifest.json (files, sizes, checksums, step, losses, config hash, layout)
  integrity.py   checksums (xxh3-64 or crc32), fsync of files and directories, atomic writes
  discovery.py   committed checkpoints newest first, resume choice, mark_bad, leftover cleanup
  retention.py   keep_last / keep_every / keep_best as a pure function, applied off-thread
  loader.py      verified (while reading), resharding load into a TrainingState
  fingerprint.py config hash and the fields a resume may change
  preflight.py   directory, write permission and room for keep_last + 1 checkpoints before step 1
  probe.py       the probe loss stored with each checkpoint
  export.py      offline tensor reading, one tensor at a time; safetensors and Hugging Face exports
  hf_config.py   Hugging Face names and config.json (torch-free); hf_weights.py: the q/k rotary permutation
  safetensors_io.py  safetensors written tensor by tensor, read in slices (a DCP StorageReader)
  weight_source.py   what a model.init_from path holds (torch-free); init_from.py: the import
  convert.py     a raw checkpoint as stock DCP files
  manager.py     what train.py calls: preflight, resume, after_step, close
"""

import warnings

# DCP warns on every single-process save/load that it "assumes the intent"; that intent is ours.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
