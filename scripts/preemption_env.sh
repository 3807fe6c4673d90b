# Sourced by the launchers with the training arguments: exports TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
# the seconds torchrun's agent leaves its workers after a preemption notice before it kills
# them, as recovery.preemption_grace_s (from an argument, else $GRACE_S, else the default 120)
# plus 30 s for the agent's own exit. An exported TORCH_ELASTIC_SHUTDOWN_TIMEOUT is kept.
GRACE_S="${GRACE_S:-120}"
for arg in "$@"; do
  case "$arg" in
    recovery.preemption_grace_s=*) GRACE_S="${arg#*=}" ;;
  esac
done
GRACE_S="${GRACE_S%.*}"  # whole seconds
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((GRACE_S + 30))}"
