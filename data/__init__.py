"""Token data on disk, the global sample order and per-rank batches."""
