#!/usr/bin/env bash
# Stop the loopback Ceph started by infra/radosgw/start.sh: kill exactly the PIDs it recorded
# (gateway first, then OSD, then monitor), then remove its state directory and env file.
# Safe to run twice, and when nothing is running.
set -uo pipefail

DIR="${CJE_RGW_DIR:-/tmp/cje-rgw}"
ENV_FILE="${CJE_RGW_ENV:-$DIR/env}"
PIDS="$DIR/pids"

log() { echo "[radosgw] $*" >&2; }

if [[ -f "$PIDS" ]]; then
    # Reverse start order: rgw, osd, mon.
    mapfile -t lines < <(tac "$PIDS")
    for line in "${lines[@]}"; do
        read -r name pid <<< "$line"
        [[ -n "${pid:-}" ]] || continue
        # Only signal the process we started: it must still run one of the Ceph daemons.
        comm=$(cat "/proc/$pid/comm" 2>/dev/null || true)
        case "$comm" in
            ceph-mon|ceph-osd|radosgw|rgw*|msgr-worker*|log|safe_timer|"") ;;
            *) log "pid $pid ($name) is now '$comm', not a Ceph daemon: leaving it alone"; continue ;;
        esac
        [[ -z "$comm" ]] && continue
        kill -TERM "$pid" 2>/dev/null || continue
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "$name ($pid) ignored SIGTERM for 5s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        log "stopped $name ($pid)"
    done
fi

rm -f "$ENV_FILE"
# CJE_RGW_KEEP_LOGS=1 keeps the state directory (logs) for diagnosis; the next start removes it.
if [[ "${CJE_RGW_KEEP_LOGS:-0}" == 1 ]]; then
    rm -f "$PIDS"
else
    rm -rf "$DIR"
fi
