#!/usr/bin/env bash
# Stop the Label Studio started by infra/labelstudio/start.sh: exactly the recorded PID's process
# group (SIGTERM, then SIGKILL), then remove its state directory.
set -Euo pipefail

DIR="${CJE_LS_DIR:-/tmp/cje-labelstudio}"
log() { echo "[labelstudio] $*" >&2; }

if [[ -f "$DIR/pid" ]]; then
    pid=$(cat "$DIR/pid")
    if kill -0 "$pid" 2>/dev/null; then
        pgid=$(ps -o pgid= -p "$pid" | tr -d ' ')
        if [[ -n "$pgid" && "$pgid" == "$pid" ]]; then
            kill -TERM -- "-$pgid" 2>/dev/null || true
        else
            kill -TERM "$pid" 2>/dev/null || true
        fi
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        if kill -0 "$pid" 2>/dev/null; then
            log "pid $pid still alive after SIGTERM: SIGKILL"
            [[ "$pgid" == "$pid" ]] && kill -KILL -- "-$pgid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        fi
        log "stopped pid $pid"
    else
        log "pid $pid is not running"
    fi
fi
rm -rf "$DIR"
