# Test tiers of .ci/run (sourced; tests/infra/test_infra.py runs it with stand-in commands).
# Every tier runs, whatever an earlier one did; each prints its result and time; `tiers_result` at the
# end prints the failing tiers and returns non-zero if there is one. Works under `set -euo pipefail`.

FAILED_TIERS=()

# tier NAME CMD...: run one test tier, print its result and how long it took. Any non-zero exit is a
# failure of the tier, pytest's 5 ("no tests collected") included: a tier that tests nothing is broken.
tier() {
    local name=$1 t0 rc result
    shift
    t0=$(date +%s)
    "$@" && rc=0 || rc=$?
    case $rc in
        0) result="passed" ;;
        5) result="FAILED (exit 5: no tests collected)" ;;
        *) result="FAILED (exit $rc)" ;;
    esac
    if (( rc != 0 )); then
        FAILED_TIERS+=("$name")
    fi
    echo "[ci] tier $name: $result in $(( $(date +%s) - t0 )) s"
}

# tiers_result: after the last tier; non-zero with the list of failing tiers.
tiers_result() {
    if (( ${#FAILED_TIERS[@]} > 0 )); then
        echo "[ci] failing tiers: ${FAILED_TIERS[*]}"
        return 1
    fi
    echo "[ci] every tier passed"
}
