"""The memory tier: snapshots in node-local shared memory, each replicated to a peer node.

  tier.py       MemoryTier: the schedule, the pre-flight, a snapshot's two halves (the training thread's
                copy; in the background: write, replicate, two-round commit, drop older steps but keep
                their files to write over), the tier's own gloo group (agreements, the replica exchange,
                copies streamed to a peer), and the restore (the newest step every rank can get an
                intact copy of, from its node or a peer)
  snapshot.py   one rank's state as one checksummed file (the format), applied and checked byte for byte
"""
