#!/usr/bin/env bash
# One node, NPROC processes (default: one per GPU; 2 on a CPU-only machine), gloo or nccl
# picked by train.py from the device. Arguments are Hydra overrides for train.py.
#
#   scripts/launch_single_node.sh +experiment=debug parallel.dp_shard=2
#   NPROC=8 scripts/launch_single_node.sh +experiment=125m parallel.tp=2
#
# MAX_RESTARTS (default 0): torchrun restarts the whole group after a failure, and train.py
# resumes from the newest committed checkpoint.
# Preemption: SIGTERM or SIGUSR1 to this script's process (it becomes the torchrun agent,
# scripts/torchrun_preemptible.py) reaches every rank, which saves and exits 0. The agent
# gives the workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT = recovery.preemption_grace_s + 30 s
# (the grace is read from the arguments, else GRACE_S, else the default 120) before SIGKILL.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/preemption_env.sh "$@"
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [[ "$NPROC" -gt 0 ]] || NPROC=2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${PYTHON:-python}" scripts/torchrun_preemptible.py --standalone --nproc-per-node "$NPROC" \
  --max-restarts "${MAX_RESTARTS:-0}" train.py "$@"
