"""The durable tier: checkpoints on shared storage, committed atomically, verified when loaded.

  saver.py       a save: host staging, DCP's write (a dedicated gloo group), the commit protocol
                 (acknowledge, collect, create the manifest, move latest), each phase agreed; a refused save
  writer.py      DCP's writer on any store, and stock DCP's data files (checkpoint.format=dcp; the
                 raw-bytes format is the raw unit's writer)
  reader.py      reads raw bytes straight into the destination tensors, checksumming as it streams
  loader.py      the verified, resharding load into a TrainingState
  manifest.py    manifest.json, the checksums (xxh3-64 or crc32), a checkpoint's errors
  discovery.py   the folder names; committed checkpoints newest first, the resume choice, BAD and
                 SUPERSEDED marks, retention (keep_last / keep_every / keep_best), leftover cleanup
  lease.py       which attempt owns checkpoint.dir: an older attempt's writer never commits
  preflight.py   before step 1: the directory is writable and has room for keep_last + 1 checkpoints
  reads.py       reads that decide for every rank: on rank 0, again while the storage fails, agreed
"""
