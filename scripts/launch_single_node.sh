#!/usr/bin/env bash
# One node, NPROC processes (default: one per GPU; 2 on a CPU-only machine), gloo or nccl
# picked by train.py from the device. Arguments are Hydra overrides for train.py.
#
#   scripts/launch_single_node.sh +experiment=debug parallel.dp_shard=2
#   NPROC=8 scripts/launch_single_node.sh +experiment=125m parallel.tp=2
#
# MAX_RESTARTS (default 0): torchrun restarts the whole group after a failure, and train.py
# resumes from the newest committed checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [[ "$NPROC" -gt 0 ]] || NPROC=2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  --max-restarts "${MAX_RESTARTS:-0}" train.py "$@"
