#!/usr/bin/env bash
# Stop the loopback stack started by infra/stack/start.sh. First a start.sh of this folder still
# running (its start.pid): it is frozen (SIGSTOP) with its own processes - those of its session that
# descend from it, never the session's other processes (its caller's) - until no new one appears, then
# killed, so it launches nothing more; the services it had launched (its children in sessions of their
# own, recorded or not yet) are noted. Then for each recorded PID, in reverse start order, signal it
# and then every process still in its session (each service was started with setsid, so its session
# id is that PID: this reaches the service's children - raylet, Ray workers, flow-run subprocesses,
# postgres backends - and nothing else), and the sessions of the noted services the pid file missed.
# Then radosgw (its own stop.sh) and the state folder. Safe to run twice, and when nothing is running.
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
DIR="${CJE_STACK_DIR:-/tmp/cje-stack}"
ENV_FILE="${CJE_STACK_ENV:-$DIR/env}"
PIDS="$DIR/pids"
STARTER="$DIR/start.pid"

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

proc_start() {  # the start time of process $1 (/proc/<pid>/stat field 22); nothing for a zombie or no process
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    stat=${stat##*) }
    # shellcheck disable=SC2086
    set -- $stat
    [[ "$1" == Z ]] || echo "${20}"
}

starter_pids() {  # start.sh $1 and its descendants through processes of its session $2 (not what it setsid)
    ps -eo pid=,ppid=,sid= | awk -v root="$1" -v s="$2" '
        { ppid[$1] = $2; sid[$1] = $3 }
        END {
            for (p in sid) {
                q = p; n = 0
                while (q > 1 && sid[q] == s && n < 64) { if (q == root) { print p; break }; q = ppid[q]; n++ }
            }
        }'
}

LAUNCHED=()
end_start() {  # a start.sh of this folder still running: end it, noting the services it launched
    local spid sstart sid own frozen="" new left p
    [[ -f "$STARTER" ]] || return 0
    read -r spid sstart < "$STARTER" || true
    [[ -n "${spid:-}" && -n "${sstart:-}" ]] || return 0
    [[ "$(proc_start "$spid")" == "$sstart" ]] || return 0    # ended (or its PID reused)
    p=$$                                                     # run by that start itself (stale state, a failed start)
    while [[ -n "$p" && "$p" -gt 1 ]]; do
        [[ "$p" == "$spid" ]] && return 0
        p=$(ps -o ppid= -p "$p" | tr -d ' ')
    done
    sid=$(ps -o sid= -p "$spid" | tr -d ' ')
    [[ -n "$sid" ]] || return 0
    log "a start of $DIR is in progress (PID $spid): ending it first"
    # Freeze it and its own processes until none is new: a frozen process forks no more, and a child it had
    # just forked is found through its (frozen, living) parent at the next look.
    while :; do
        own=$(starter_pids "$spid" "$sid")
        new=$(comm -13 <(sort <<< "$frozen") <(sort <<< "$own") | grep . || true)
        [[ -z "$new" ]] && break
        # shellcheck disable=SC2086
        kill -STOP $new 2>/dev/null || true
        frozen=$(printf '%s\n%s' "$frozen" "$new" | grep . | sort -u)
    done
    # Its children that left its session (setsid): the services it launched, recorded in the pid file or not yet.
    mapfile -t LAUNCHED < <(ps -eo pid=,ppid=,sid= | awk -v s="$sid" -v own="$(echo $frozen)" '
        BEGIN { n = split(own, o, " "); for (i = 1; i <= n; i++) mine[o[i]] = 1 }
        $3 != s && ($2 in mine) { print $1 }')
    # shellcheck disable=SC2086
    kill -KILL $frozen 2>/dev/null || true
    for _ in $(seq 1 50); do
        left=""
        for p in $frozen; do [[ -n "$(proc_start "$p")" ]] && left+=" $p"; done
        [[ -z "$left" ]] && break
        sleep 0.1
    done
    [[ -n "$left" ]] && log "processes of the start still there after SIGKILL:$left"
    log "ended the start in progress (PID $spid; $(echo $frozen | wc -w) process(es)); ${#LAUNCHED[@]} service(s) it launched to stop"
}
end_start

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

# What the start launched that the pid file does not name (launched as stop.sh ended it; radosgw's daemons, which
# its own pid file names): each is its session's leader; stopping one already stopped does nothing.
for pid in "${LAUNCHED[@]}"; do
    [[ -n "$pid" ]] && stop_session "launched by the start (PID $pid)" "$pid" TERM
done

if [[ -d "$DIR/rgw" ]]; then
    CJE_RGW_DIR="$DIR/rgw" CJE_RGW_ENV="$DIR/rgw.env" bash "$ROOT/infra/radosgw/stop.sh" || true
fi

rm -f "$ENV_FILE"
if [[ "${CJE_STACK_KEEP_LOGS:-0}" == 1 ]]; then
    rm -f "$PIDS"
else
    rm -rf "$DIR"
fi
