# Sourced by the launchers with the training arguments: exports TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
# the seconds torchrun's agent leaves its workers after a preemption notice before it kills
# them, as recovery.preemption_grace_s (from an argument, else $GRACE_S, else the default 120)
# plus 30 s for the agent's own exit. An exported TORCH_ELASTIC_SHUTDOWN_TIMEOUT is kept.
# A grace that is not a plain number of seconds (nan, inf, abc, a negative one) sets nothing: the
# launcher's config check (scripts/torchrun_preemptible.py) then refuses it, naming the key, with exit 2.
GRACE_S="${GRACE_S:-120}"
for arg in "$@"; do
  case "$arg" in
    recovery.preemption_grace_s=*|++recovery.preemption_grace_s=*) GRACE_S="${arg#*=}" ;;
  esac
done
# whole seconds (120.5, 1e3 too); at most 9 digits, far above the config's own bound
if [[ -n "$GRACE_S" ]] && GRACE_WHOLE=$(LC_ALL=C printf '%.0f' "$GRACE_S" 2>/dev/null) && [[ "$GRACE_WHOLE" =~ ^[0-9]{1,9}$ ]]; then
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((10#$GRACE_WHOLE + 30))}"
fi
