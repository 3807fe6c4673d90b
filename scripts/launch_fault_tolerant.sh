#!/usr/bin/env bash
# Replica groups under torchft on one host (parallel.fault_tolerance, docs/recovery-runbook.md "Fault
# tolerance across replica groups"): a Lighthouse, then one torchrun per group (NPROC ranks each: dp_shard x tp
# inside the group). A group that fails is restarted by its own torchrun (MAX_RESTARTS) and takes the live state
# from a peer; the other groups go on. Arguments are Hydra overrides for train.py, given to every group.
#
#   scripts/launch_fault_tolerant.sh +experiment=debug
#   GROUPS_N=2 NPROC=2 RUN_DIR=outputs/ft scripts/launch_fault_tolerant.sh +experiment=debug
#
# Each group's agent is scripts/torchrun_preemptible.py: it runs train.py's checks once before its workers, and
# SIGTERM or SIGUSR1 to it (this script passes a SIGTERM on to every group) saves and stops the group.
# Group g runs in RUN_DIR/group_g (its metrics, its fault_tolerance.jsonl); the groups share
# CHECKPOINT_DIR (default RUN_DIR/checkpoints), where each step's durable save is written by the first group of its quorum. The
# Lighthouse binds LIGHTHOUSE_BIND (default 127.0.0.1:29510: this host only); it is the one process every group
# needs (a single point of failure) and stops when this script ends.
# SLURM: scripts/train_fault_tolerant.sbatch.
set -euo pipefail
cd "$(dirname "$0")/.."
GROUPS_N="${GROUPS_N:-2}"
NPROC="${NPROC:-1}"
RUN_DIR="${RUN_DIR:-outputs/fault-tolerant}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$RUN_DIR/checkpoints}"  # shared by the groups (a folder or s3://)
LIGHTHOUSE_BIND="${LIGHTHOUSE_BIND:-127.0.0.1:29510}"
MIN_REPLICAS="${MIN_REPLICAS:-1}"
PYTHON="${PYTHON:-python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

source scripts/lighthouse.sh
PIDS=()
notice=""
stop() { kill "${PIDS[@]}" $LIGHTHOUSE_PID 2>/dev/null || true; }
trap stop EXIT
trap 'notice=TERM; kill -TERM "${PIDS[@]}" 2>/dev/null || true' TERM
start_lighthouse "$LIGHTHOUSE_BIND" || exit 1

for ((g = 0; g < GROUPS_N; g++)); do
  [[ -z "$notice" ]] || break  # a SIGTERM while the groups were being started: the rest are not
  "$PYTHON" scripts/torchrun_preemptible.py --standalone --nproc-per-node "$NPROC" --max-restarts "${MAX_RESTARTS:-3}" \
    train.py "$@" run_dir="$RUN_DIR/group_$g" checkpoint.dir="$CHECKPOINT_DIR" \
    parallel.fault_tolerance.enabled=true \
    parallel.fault_tolerance.lighthouse="http://$LIGHTHOUSE_BIND" parallel.fault_tolerance.groups="$GROUPS_N" \
    parallel.fault_tolerance.min_replicas="$MIN_REPLICAS" parallel.fault_tolerance.replica_id="$g" \
    parallel.fault_tolerance.hostname="${HOSTNAME_ADVERTISED:-${LIGHTHOUSE_BIND%:*}}" &
  PIDS+=($!)
done
status=0
for pid in "${PIDS[@]}"; do
  while true; do  # a trapped SIGTERM interrupts wait: wait again until the group has ended
    rc=0; wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  (( rc == 0 )) || status=$rc
done
exit "$status"
