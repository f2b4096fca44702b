#!/usr/bin/env bash
# Stop the loopback stack started by infra/stack/start.sh: for each recorded PID, in reverse start
# order, signal it and then every process still in its session (each service was started with
# setsid, so its session id is that PID: this reaches the service's children - raylet, Ray workers,
# flow-run subprocesses, postgres backends - and nothing else). Then radosgw (its own stop.sh) and
# the state folder. Safe to run twice, and when nothing is running.
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
DIR="${CJE_STACK_DIR:-/tmp/cje-stack}"
ENV_FILE="${CJE_STACK_ENV:-$DIR/env}"
PIDS="$DIR/pids"

log() { echo "[stack] $*" >&2; }

session_pids() {  # processes whose session id is $1, and their descendants in other sessions
    # (the Prefect process worker starts each flow run in a session of its own)
    ps -eo pid=,ppid=,sid= | awk -v s="$1" '
        { ppid[$1] = $2; sid[$1] = $3 }
        END {
            for (p in sid) {
                q = p; n = 0
                while (q > 1 && n < 64) { if (sid[q] == s) { print p; break }; q = ppid[q]; n++ }
            }
        }'
}

stop_session() {  # name, pid, first signal
    local name=$1 pid=$2 sig=$3 left
    left=$(session_pids "$pid")
    [[ -z "$left" ]] && return 0
    # shellcheck disable=SC2086
    kill -"$sig" $left 2>/dev/null || true
    for _ in $(seq 1 50); do
        left=$(session_pids "$pid")
        [[ -z "$left" ]] && break
        sleep 0.2
    done
    if [[ -n "$left" ]]; then
        log "$name: $(echo $left | wc -w) process(es) ignored SIG$sig for 10 s: SIGKILL"
        # shellcheck disable=SC2086
        kill -KILL $left 2>/dev/null || true
    fi
    log "stopped $name (session $pid)"
}

if [[ -f "$PIDS" ]]; then
    mapfile -t lines < <(tac "$PIDS")
    for line in "${lines[@]}"; do
        read -r name pid <<< "$line"
        [[ -n "${pid:-}" ]] || continue
        case "$name" in
            rgw-*) continue ;;                        # radosgw: its own stop.sh below
            postgres) stop_session "$name" "$pid" INT ;;   # SIGINT = PostgreSQL's fast shutdown
            *) stop_session "$name" "$pid" TERM ;;
        esac
    done
fi

if [[ -d "$DIR/rgw" ]]; then
    CJE_RGW_DIR="$DIR/rgw" CJE_RGW_ENV="$DIR/rgw.env" bash "$ROOT/infra/radosgw/stop.sh" || true
fi

rm -f "$ENV_FILE"
if [[ "${CJE_STACK_KEEP_LOGS:-0}" == 1 ]]; then
    rm -f "$PIDS"
else
    rm -rf "$DIR"
fi
