# Test tiers of .ci/run (sourced; tests/infra/test_infra.py runs it with stand-in commands).
# Every tier runs, whatever an earlier one did; each prints its result and time; `tiers_result` at the
# end prints the failing tiers and returns non-zero if there is one. Works under `set -euo pipefail`.

FAILED_TIERS=()

# tier NAME CMD...: run one test tier, print its result and how long it took. Any non-zero exit is a
# failure of the tier, pytest's 5 ("no tests collected") included: a tier that tests nothing is broken.
tier() {
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    "$@" && rc=0 || rc=$?
    tier_done "$name" "$rc" "$t0" ""
}

# tier_done NAME RC T0 NOTE [T_END]: a tier's result line (from its exit code RC, its start T0 and its end T_END,
# now if not given), a failure recorded.
tier_done() {
    local result
    case $2 in
        0) result="passed" ;;
        5) result="FAILED (exit 5: no tests collected)" ;;
        *) result="FAILED (exit $2)" ;;
    esac
    if (( $2 != 0 )); then
        FAILED_TIERS+=("$1")
    fi
    echo "[ci] tier $1: $result in $(( ${5:-$(date +%s)} - $3 )) s$4"
}

# tiers_result: after the last tier; non-zero with the list of failing tiers.
tiers_result() {
    if (( ${#FAILED_TIERS[@]} > 0 )); then
        echo "[ci] failing tiers: ${FAILED_TIERS[*]}"
        return 1
    fi
    echo "[ci] every tier passed"
}

# tier_start NAME CMD...: a tier run in the background (its own session; output in a log file of its own), beside
# the tiers that follow; `tier_wait NAME` waits for it, prints its output and result as `tier` does, with the time
# it took (its end is written when it ends, not when it is waited for). A tier started and never waited for is
# killed at exit by `tier_stop_all` (.ci/run's stops).
declare -A TIER_PID=() TIER_LOG=() TIER_T0=()
tier_start() {
    local name=$1
    shift
    TIER_LOG[$name]=$(mktemp "/tmp/cje-tier-$name-XXXXXX")
    TIER_T0[$name]=$(date +%s)
    TIER_END_FILE="${TIER_LOG[$name]}.end" setsid bash -c '"$@"; rc=$?; date +%s > "$TIER_END_FILE"; exit "$rc"' \
        "$name" "$@" > "${TIER_LOG[$name]}" 2>&1 < /dev/null &
    TIER_PID[$name]=$!
    echo "[ci] tier $name started in the background"
}

tier_wait() {
    local name=$1 rc t_end
    wait "${TIER_PID[$name]}" && rc=0 || rc=$?
    unset "TIER_PID[$name]"
    t_end=$(cat "${TIER_LOG[$name]}.end" 2>/dev/null || date +%s)
    cat "${TIER_LOG[$name]}"
    rm -f "${TIER_LOG[$name]}" "${TIER_LOG[$name]}.end"
    tier_done "$name" "$rc" "${TIER_T0[$name]}" " (in the background)" "$t_end"
}

# tier_wait_any NAME...: block until the first of these background tiers has ended (its end file written, or its
# process gone), and print which; none is reaped (each is still waited for with `tier_wait`, for its result).
tier_wait_any() {
    local name t0
    t0=$(date +%s)
    while true; do
        for name in "$@"; do
            if [[ -e "${TIER_LOG[$name]}.end" ]] || ! kill -0 "${TIER_PID[$name]}" 2>/dev/null; then
                echo "[ci] tier $name ended first (waited $(( $(date +%s) - t0 )) s)"
                return 0
            fi
        done
        sleep 1
    done
}

tier_stop_all() {
    local name
    for name in "${!TIER_PID[@]}"; do
        # its session (a tier just started may not have made it yet: then the process itself)
        kill -TERM -- "-${TIER_PID[$name]}" 2>/dev/null || kill -TERM "${TIER_PID[$name]}" 2>/dev/null || true
    done
}
