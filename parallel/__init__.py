"""Process groups, the device mesh layout, and how the model is parallelised over it.

  init.py            process-group start-up: backend by device, explicit timeouts, die with the launcher
  dims.py            the layout: world = dp_replicate x dp_shard x tp, checked against the world
  mesh.py            the DeviceMesh of a layout
  parallelize.py     the layout applied to a meta-built model: the model's plan (model/parallelize.py)
                     with the layout's mesh and the config's options
  fsdp.py            FSDP2 units over the data-parallel mesh
  activations.py     activation checkpointing (full, selective) and per-block compile
  materialize.py     storage and initial values, each rank its own shards
  collectives.py     rank agreement: one rank decides, or every rank votes
  checks.py          the parallel section's config checks
"""
