"""Token data on disk, the global sample order and per-rank batches.

  prepared.py    DataError; the prepare command (advice, and data.prepare_if_missing runs it)
  tokenizer.py   the tokenizers a run reads: bytes, a saved BPE, a tokenizer.json; their identity
  formats/       the shard contract and one module per format on disk, found by a registry
  token_source.py   a data.path's shards cut into training windows
  order.py, permutation.py, mixture.py   the global sample order, independent of the rank count
  batching.py    global = dp x micro x accum
  pipeline.py, dataset.py, setup.py   per-rank micro-batches through a StatefulDataLoader
  state.py       the data position a checkpoint stores
  validation.py  which dataset a run validates on
  checks.py      the data section's config checks and its file probes
  prep/          offline preparation (corpora, the held-out split, BPE training, writers): never imported by a run
"""
