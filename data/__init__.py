"""Token data on disk, the global sample order and per-rank batches.

  token_file.py, token_source.py   prepared tokens on disk, cut into training windows
  tokenizer.py, sources.py, split.py   preparation: tokenizers, corpora and file formats, the held-out split
  shard_prep.py  preparation in N processes into a folder of shards, resumable
  foreign.py, megatron_source.py, datatrove_source.py   other engines' token files, read in place
  prepared.py    a prepared dataset's description, folder name and prepare command; DataError
  order.py, permutation.py, mixture.py   the global sample order, independent of the rank count
  batching.py    global = dp x micro x accum
  pipeline.py, dataset.py, setup.py   per-rank micro-batches through a StatefulDataLoader
  state.py       the data position a checkpoint stores
  validation.py  which dataset a run validates on
  checks.py      the data section's config checks and its file probes
"""
