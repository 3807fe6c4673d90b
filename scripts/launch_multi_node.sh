#!/usr/bin/env bash
# Run the same command on every node. torchrun's c10d rendezvous forms the group; its store
# lives in the agent on RDZV_HOST (the endpoint): losing that node ends the job, losing any
# other re-forms it (docs/recovery-runbook.md: where to put the endpoint). An elastic range
# NNODES=MIN:MAX lets the job start, or restart after a node is lost, with any node count in
# the range. dp_shard=-1 then fills the new world size and train.py recomputes grad
# accumulation so the global batch stays the same, where it splits over that many data-parallel
# ranks: the config check (scripts/torchrun_preemptible.py) refuses a range whose largest world
# size cannot run the layout and warns of the smaller ones that cannot, naming those that work.
# The 70b recipe runs at 64, 32 or 16 nodes only (its 512 sequences split over 64, 32 or 16
# data-parallel ranks), so its node count is fixed (min = max); a lost node's replacement rejoins:
#
#   RDZV_HOST=node0 NNODES=64 NPROC=8 RUN_ID=llama3-70b \
#     scripts/launch_multi_node.sh +experiment=70b
#
# MAX_RESTARTS (default 3): group restarts after a failure before torchrun gives up; every
# restart resumes from the newest committed checkpoint. RDZV_PORT defaults to 29400.
# RDZV_IS_HOST=false on every node when the store runs elsewhere (scripts/rendezvous_store.py).
# RDZV_CONF_EXTRA: more --rdzv-conf keys, e.g. keep_alive_interval=5,keep_alive_max_attempt=3
# (how long a lost node's heartbeat is waited for).
# Multi-node environment (docs/recovery-runbook.md, "Multi-node jobs: what to set"): the agent sets
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a replacement node joins only with it); export
# GLOO_SOCKET_IFNAME=<interface> on every node, the one the nodes reach each other on.
# Preemption: SIGTERM or SIGUSR1 to this script's process (the agent,
# scripts/torchrun_preemptible.py) reaches every local rank; all ranks save at one step and
# exit 0. TORCH_ELASTIC_SHUTDOWN_TIMEOUT = recovery.preemption_grace_s + 30 s.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RDZV_HOST:?set RDZV_HOST to the host name of one node (the rendezvous host)}"
: "${NNODES:?set NNODES to a node count or a MIN:MAX range}"
source scripts/preemption_env.sh "$@"
NPROC="${NPROC:-8}"
RDZV_CONF="join_timeout=${JOIN_TIMEOUT_S:-600}"
[[ -n "${RDZV_IS_HOST:-}" ]] && RDZV_CONF="$RDZV_CONF,is_host=$RDZV_IS_HOST"
[[ -n "${RDZV_CONF_EXTRA:-}" ]] && RDZV_CONF="$RDZV_CONF,$RDZV_CONF_EXTRA"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${PYTHON:-python}" scripts/torchrun_preemptible.py \
  --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:${RDZV_PORT:-29400}" --rdzv-id "${RUN_ID:-llm-trainer}" \
  --rdzv-conf "$RDZV_CONF" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  train.py "$@"
