"""Token data on disk, read in place: one module per format, the contract they share, the registry.

  shard.py       the shard contract (Shard, Format, ShardMeta), the windows, what formats share
  native.py      this project's prepared datasets (tokens.bin + meta.json) and folders of them
  megatron.py    Megatron's indexed datasets (.bin + .idx)
  datatrove.py   datatrove's tokenised output (.ds, .ds.index, .ds.metadata)
  registry.py    which format a data.path holds
"""
