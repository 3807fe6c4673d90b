#!/usr/bin/env bash
# Run the same command on every node. torchrun's c10d rendezvous (hosted by the torchrun on
# RDZV_HOST) forms the group; an elastic range NNODES=MIN:MAX lets the job start, or restart
# after a node is lost, with any node count in the range. dp_shard=-1 then fills the new
# world size and train.py recomputes grad accumulation so the global batch stays the same.
#
#   RDZV_HOST=node0 NNODES=60:64 NPROC=8 RUN_ID=llama3-70b \
#     scripts/launch_multi_node.sh +experiment=70b
#
# MAX_RESTARTS (default 3): group restarts after a failure before torchrun gives up; every
# restart resumes from the newest committed checkpoint. RDZV_PORT defaults to 29400.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RDZV_HOST:?set RDZV_HOST to the host name of one node (the rendezvous host)}"
: "${NNODES:?set NNODES to a node count or a MIN:MAX range}"
NPROC="${NPROC:-8}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m torch.distributed.run \
  --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:${RDZV_PORT:-29400}" --rdzv-id "${RUN_ID:-llm-trainer}" \
  --rdzv-conf "join_timeout=${JOIN_TIMEOUT_S:-600}" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  train.py "$@"
