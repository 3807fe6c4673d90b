"""The durable tier: checkpoints on shared storage, committed atomically, verified when loaded.

  saver.py        sync and async saves (a dedicated gloo group), phases with fault hooks, each agreed;
                  a save the storage refused (disk full, read-only, quota): the message, the numbers
  writer.py       the data files: raw tensor bytes, checksummed as they are written (the format)
  reader.py       a DCP StorageReader that reads raw bytes straight into the destination tensors: the
                  read plan of one file (byte segments, read streams, the checksum in file order)
  commit.py       acknowledge -> collect -> create the manifest (the commit) -> latest pointer
  lease.py        which attempt owns checkpoint.dir: an older attempt's writer never commits
  manifest.py     manifest.json (files, sizes, checksums, step, losses, config hash, layout), the
                  checksums (xxh3-64 or crc32), a checkpoint's errors
  discovery.py    the folder names; committed checkpoints newest first, the resume choice, BAD and
                  SUPERSEDED marks, retention (keep_last / keep_every / keep_best), leftover cleanup
  preflight.py    directory, write permission and room for keep_last + 1 checkpoints before step 1
  loader.py       the verified (while reading), resharding load into a TrainingState
  reads.py        reads that decide for every rank: on rank 0, again while the storage fails, agreed
"""
