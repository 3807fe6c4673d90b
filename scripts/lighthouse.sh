# Sourced by scripts/launch_fault_tolerant.sh and scripts/train_fault_tolerant.sbatch. `start_lighthouse HOST:PORT`
# starts torchft's Lighthouse in the background (its pid in LIGHTHOUSE_PID) and returns once it accepts connections,
# so that no group is started before it: the Lighthouse imports torch and took 1.8 s to listen on an idle machine,
# longer under load, and a group gives up after parallel.fault_tolerance.timeout_s. It fails (status 1, with the
# reason) if something listens on the port already, if the Lighthouse exits first (its port bound) or if it does
# not listen within LIGHTHOUSE_START_S (120), or if the launcher's trap records a signal in `notice` meanwhile (a
# preemption notice: the launcher then starts no group). MIN_REPLICAS, JOIN_TIMEOUT_MS and HEARTBEAT_TIMEOUT_MS as
# in the launchers; LIGHTHOUSE_BIN defaults to the torchft_lighthouse beside $PYTHON.
LIGHTHOUSE_BIN="${LIGHTHOUSE_BIN:-$(dirname "$(command -v "$PYTHON")")/torchft_lighthouse}"
LIGHTHOUSE_PID=""
start_lighthouse() {
  local bind="$1" host="${1%:*}" port="${1##*:}" deadline=$((SECONDS + ${LIGHTHOUSE_START_S:-120}))
  case "$host" in 0.0.0.0|"[::]"|"") host=127.0.0.1 ;; esac  # every interface: this host answers on loopback
  if (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then  # a connect below could not tell it from the Lighthouse
    echo "$(basename "$0"): something already listens on $bind, the Lighthouse's address: stop it or pick another" \
         "port; no group started" >&2
    return 1
  fi
  "$LIGHTHOUSE_BIN" --bind "$bind" --min_replicas "$MIN_REPLICAS" --join_timeout_ms "${JOIN_TIMEOUT_MS:-5000}" \
    --quorum_tick_ms 100 --heartbeat_timeout_ms "${HEARTBEAT_TIMEOUT_MS:-5000}" &
  LIGHTHOUSE_PID=$!
  until (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; do
    if [[ -n "${notice:-}" ]]; then
      echo "$(basename "$0"): SIG$notice received while waiting for the Lighthouse; no group started" >&2
      return 1
    fi
    if ! kill -0 "$LIGHTHOUSE_PID" 2>/dev/null; then
      local status=0
      wait "$LIGHTHOUSE_PID" || status=$?
      echo "$(basename "$0"): the Lighthouse ($LIGHTHOUSE_BIN) exited with status $status before it listened on $bind" \
           "(its error is above; a port in use: pick another); no group started" >&2
      return 1
    fi
    if (( SECONDS >= deadline )); then
      kill "$LIGHTHOUSE_PID" 2>/dev/null || true
      echo "$(basename "$0"): the Lighthouse did not listen on $bind within ${LIGHTHOUSE_START_S:-120} s" \
           "(LIGHTHOUSE_START_S); no group started" >&2
      return 1
    fi
    sleep 0.1
  done
}
