#!/usr/bin/env bash
# Start the production topology on loopback, for the stack test tier (tests/stack/) and
# benchmarks/bench_stack.py:
#
#   PostgreSQL (Debian's package, a private cluster made with initdb)
#     -> Prefect API server on it (postgresql+asyncpg)
#     -> a process work pool and one Prefect worker
#   a two-node Ray cluster (`ray start --head` + `ray start --address`, 1 CPU each, Ray Client on)
#   Ceph radosgw S3 (infra/radosgw/start.sh, in this stack's own state folder)
#
# Everything binds 127.0.0.1 on ports chosen free at start; every daemon runs in its own session
# (setsid) and its PID is recorded, so stop.sh ends exactly what this script started; while it runs, its
# own PID is recorded too ($CJE_STACK_DIR/start.pid), so a stop.sh run meanwhile ends this start first.
#
#   bash infra/stack/start.sh      # prints the env file path (~30-60 s)
#   bash infra/stack/stop.sh
#
# Environment (all optional):
#   CJE_STACK_DIR     state folder (logs, data, pids, launch scripts)   default /tmp/cje-stack
#   CJE_STACK_ENV     env file written for the tests                     default $CJE_STACK_DIR/env
#   CJE_PYTHON        the Python whose prefect / ray / cje are used      default <repo>/.venv/bin/python
#   CJE_STACK_RAY_OBJECT_STORE  bytes of object store per Ray node       default 2 GiB
#   CJE_STACK_NO_RGW=1          no radosgw (S3 settings then come from the caller's environment)
#   CJE_STACK_RAY_WAIT          seconds to wait for each Ray node to join                   default 180
#
# The env file holds NAME=value lines: PREFECT_API_URL, CJE_STACK_POOL, RAY_ADDRESS (ray://),
# CJE_STACK_RAY_GCS, RAY_AUTH_MODE, RAY_AUTH_TOKEN, the S3 settings of infra/radosgw/start.sh,
# CJE_STACK_PG_URL, and CJE_STACK_PIDS / CJE_STACK_RUN (the pid file and the folder of per-service
# launch scripts the fault tests use to restart a service).
set -Eeuo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
DIR="${CJE_STACK_DIR:-/tmp/cje-stack}"
ENV_FILE="${CJE_STACK_ENV:-$DIR/env}"
PY="${CJE_PYTHON:-$ROOT/.venv/bin/python}"
BIN="$(dirname "$PY")"
OBJ_STORE="${CJE_STACK_RAY_OBJECT_STORE:-2147483648}"
POOL="cje-process"
RAY_WAIT="${CJE_STACK_RAY_WAIT:-180}"
T0=$(date +%s.%N)

log() { echo "[stack] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
elapsed() { python3 -c "import time; print(f'{time.time() - $T0:.1f}')"; }

[[ -x "$PY" ]] || die "no Python at $PY (create the venv first, or set CJE_PYTHON)"
[[ -x "$BIN/prefect" && -x "$BIN/ray" ]] || die "prefect / ray not installed next to $PY"

export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0 \
       RAY_USAGE_STATS_PROMPT_ENABLED=0

# This start in progress, recorded in the folder from its first step to its last ("<PID> <start time>": a PID
# reused by another process is not it): stop.sh run meanwhile ends it, and what it started, before it reads the
# pid files (else a service this start launches while stop.sh runs is never recorded where stop.sh looks, and
# never stopped). Written again once the folder is made anew below.
STARTER="$DIR/start.pid"
record_start() { mkdir -p "$DIR" && echo "$$ $(sed 's/.*) //' "/proc/$$/stat" | cut -d' ' -f20)" > "$STARTER"; }
record_start

# ---------------------------------------------------------------------------------------------
# 0. Already up? Reuse it. Stale state: stop it first.
# ---------------------------------------------------------------------------------------------
if [[ -f "$DIR/pids" && -f "$ENV_FILE" ]]; then
    api=$(grep '^PREFECT_API_URL=' "$ENV_FILE" | cut -d= -f2-)
    if curl -fsS -o /dev/null --max-time 3 "$api/health"; then
        log "already running (env file $ENV_FILE)"
        rm -f "$STARTER"
        echo "$ENV_FILE"
        exit 0
    fi
    log "stale state in $DIR: stopping it first"
    bash "$HERE/stop.sh" >/dev/null 2>&1 || true
fi

free_port() {  # below the ephemeral range, so no outgoing connection takes it before its service binds it
    python3 "$ROOT/infra/free_port.py"
}

rm -rf "$DIR"
mkdir -p "$DIR"/{run,logs,pg} "$(dirname "$ENV_FILE")"
chmod 755 "$DIR"
record_start
PIDS="$DIR/pids"
: > "$PIDS"

on_error() {
    log "start failed; last log lines:"
    for f in "$DIR"/logs/*.log "$DIR"/pg/*.log; do
        [[ -s "$f" ]] && { echo "== $f" >&2; tail -n 20 "$f" >&2; }
    done
    CJE_STACK_KEEP_LOGS=1 bash "$HERE/stop.sh" >/dev/null 2>&1 || true
    log "stopped; logs kept in $DIR"
}
STARTED=0
trap '[[ $STARTED == 1 ]] || on_error' EXIT

wait_for() {  # description, timeout seconds, command...
    local what=$1 timeout=$2; shift 2
    local deadline=$(( $(date +%s) + timeout ))
    until "$@" >/dev/null 2>&1; do
        if (( $(date +%s) >= deadline )); then log "timed out after ${timeout}s waiting for $what"; return 1; fi
        sleep 0.3
    done
}

# A service = a launch script in $DIR/run/<name>.sh (kept, so tests can restart it), run in its
# own session with its output in $DIR/logs/<name>.log; "<name> <pid>" goes to $PIDS.
launch() {  # name (the script $DIR/run/<name>.sh must exist)
    local name=$1
    setsid bash "$DIR/run/$name.sh" >> "$DIR/logs/$name.log" 2>&1 < /dev/null &
    echo "$name $!" >> "$PIDS"
}
write_service() {  # name, then the script body on stdin
    { echo '#!/usr/bin/env bash'; echo "# launch script of the stack service '$1' (infra/stack/start.sh)"; cat; } > "$DIR/run/$1.sh"
}

# ---------------------------------------------------------------------------------------------
# 1. S3: radosgw in this stack's folder (its own free ports).
# ---------------------------------------------------------------------------------------------
RGW_ENV="$DIR/rgw.env"
if [[ "${CJE_STACK_NO_RGW:-0}" != 1 ]]; then
    CJE_RGW_DIR="$DIR/rgw" CJE_RGW_ENV="$RGW_ENV" bash "$ROOT/infra/radosgw/start.sh" >/dev/null &
    RGW_JOB=$!
fi

# ---------------------------------------------------------------------------------------------
# 2. PostgreSQL: Debian's server binaries, a private cluster, loopback only.
# ---------------------------------------------------------------------------------------------
pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
# One apt-get at a time (radosgw's start, below in the background, and a second stack may install too).
[[ -z "$(pg_bin)" ]] && { exec 8> /tmp/cje-apt.lock; flock 8; }
if [[ -z "$(pg_bin)" ]]; then
    SUDO=""; [[ $(id -u) != 0 ]] && SUDO="sudo"
    log "installing postgresql (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq >/dev/null || die "apt-get update failed"
    $SUDO apt-get install -y -qq postgresql >/dev/null || die "apt-get install postgresql failed"
fi
exec 8>&-  # the apt lock, if this script took it (closing a closed descriptor is no error)
PGBIN="$(pg_bin)"
PG_PORT=$(free_port)
PGDATA="$DIR/pg/data"
# PostgreSQL refuses to run as root: as root, run it as the package's `postgres` user.
AS=()
if [[ $(id -u) == 0 ]]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    chown postgres "$DIR/pg"
    AS=(runuser -u postgres --)
fi
"${AS[@]}" "$PGBIN/initdb" -D "$PGDATA" -U prefect --auth=trust -E UTF8 --no-instructions >"$DIR/pg/initdb.log" 2>&1 \
    || die "initdb failed (see $DIR/pg/initdb.log)"
# A SIGKILLed postmaster leaves postmaster.pid and its socket's lock file, and PostgreSQL refuses to start
# while a process with the PID they name exists (for another user, kill -0 answers EPERM, which counts too):
# a reused PID, or the killed postmaster itself as a zombie not yet reaped by whoever inherited it (seen:
# "lock file postmaster.pid already exists", PostgreSQL never back). The launch script removes each file
# unless its PID is a live postgres on this data folder.
write_service postgres <<EOF
for lock in "$PGDATA/postmaster.pid" "$DIR/pg/.s.PGSQL.$PG_PORT.lock"; do
    [[ -f "\$lock" ]] || continue
    old=\$(head -n 1 "\$lock" | tr -dc 0-9)
    state=\$(sed -n 's/^[^)]*) \\([A-Za-z]\\).*/\\1/p' "/proc/\$old/stat" 2>/dev/null)
    if [[ -z "\$state" || "\$state" == Z ]] || ! tr '\\0' ' ' < "/proc/\$old/cmdline" 2>/dev/null | grep -qF -- "$PGDATA"; then
        echo "[postgres] removing the stale \$lock of PID \$old (state \${state:-gone})" >&2
        rm -f "\$lock"
    fi
done
exec ${AS[*]} "$PGBIN/postgres" -D "$PGDATA" -h 127.0.0.1 -p $PG_PORT -k "$DIR/pg" -c fsync=off -c max_connections=200
EOF
launch postgres
wait_for "PostgreSQL on port $PG_PORT" 30 "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"
psql -q -h 127.0.0.1 -p "$PG_PORT" -U prefect -d postgres -c "CREATE DATABASE prefect" >/dev/null
PG_URL="postgresql+asyncpg://prefect@127.0.0.1:$PG_PORT/prefect"
log "PostgreSQL up on 127.0.0.1:$PG_PORT ($(elapsed)s)"

# ---------------------------------------------------------------------------------------------
# 3. Prefect API server on PostgreSQL (scheduler and heartbeat services on short loops for tests).
# ---------------------------------------------------------------------------------------------
API_PORT=$(free_port)
API="http://127.0.0.1:$API_PORT/api"
mkdir -p "$DIR/prefect-server"
write_service prefect-server <<EOF
unset PREFECT_API_URL PREFECT_API_KEY
export PREFECT_HOME="$DIR/prefect-server" PREFECT_API_DATABASE_CONNECTION_URL="$PG_URL"
export PREFECT_SERVER_API_HOST=127.0.0.1 PREFECT_SERVER_API_PORT=$API_PORT PREFECT_UI_ENABLED=false
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PREFECT_LOGGING_LEVEL=WARNING
export PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS=5
export PREFECT_SERVER_SERVICES_LATE_RUNS_LOOP_SECONDS=5
# Leases of deployment concurrency slots survive a server restart (the default keeps them in memory).
export PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem
# Restarted when it exits, as compose's \`restart: unless-stopped\` does (infra/compose.yaml): a server started
# while PostgreSQL is down exits ("Application startup failed") and must come back once the database does
# (seen in the chaos soak: a Prefect server crash and a PostgreSQL kill in one round left the API down for good).
# Killing the service's session (stop.sh, the fault tests) stops this loop with the server.
while true; do
    "$BIN/prefect" server start --host 127.0.0.1 --port $API_PORT
    echo "[prefect-server] exited with status \$?: starting it again in 2 s" >&2
    sleep 2
done
EOF
launch prefect-server

# ---------------------------------------------------------------------------------------------
# 4. Ray: head + one worker node, 1 CPU each, every port chosen free, token auth.
# ---------------------------------------------------------------------------------------------
RAY_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
GCS_PORT=$(free_port); CLIENT_PORT=$(free_port)
ray_ports() {  # the ports a Ray node opens, each free (Ray's defaults are fixed numbers)
    echo --node-manager-port=$(free_port) --object-manager-port=$(free_port) \
         --runtime-env-agent-port=$(free_port) --dashboard-agent-grpc-port=$(free_port) \
         --dashboard-agent-listen-port=$(free_port) --metrics-export-port=$(free_port) \
         --min-worker-port=0 --max-worker-port=0
}
# Ray's idle loops, longer (an idle stack cost 0.10-0.15 CPU s a second, and the service tier runs two for ~30 min):
# the log monitor lists the log folder every 0.1 s while it holds under 1,000 files (a folder that gains two files
# per Ray worker, ~5 a flow run), every 2 s here; each node's dashboard agent reports the node's process stats
# every 5 s, every 60 s here (nothing reads them: no dashboard). With one log monitor (the worker node's is off,
# below) the monitor's CPU fell from 4.0 to 0.8 s in 90 s of an idle stack after five runs (measured 6 December).
RAY_ENV="export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$RAY_TOKEN RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1
export RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0 LOG_NAME_UPDATE_INTERVAL_S=2 REPORTER_UPDATE_INTERVAL_MS=60000
export PYTHONPATH=\"$ROOT\${PYTHONPATH:+:\$PYTHONPATH}\""
# Under CPU load a node's raylet gives up after ~16 s waiting for its dashboard agent ("Timed out waiting
# for file .../dashboard_agent_listen_port_..."; seen at a load of 12-18 on 2 cores): `ray start` is tried
# again, up to 5 times, after stopping what the failed attempt left in this service's session. A head that
# ran for over 90 s and then stopped is not restarted here (its host's supervisor, here the fault tests,
# relaunches it).
RETRY_START=$(cat <<'SH'
for attempt in 1 2 3 4 5; do
    t0=$(date +%s)
    "$@" && exit 0
    (( $(date +%s) - t0 > 90 )) && exit 1
    echo "[ray] ray start failed (attempt $attempt of 5); again in 2 s" >&2
    for p in $(ps -eo pid=,sid= | awk -v s=$$ '$2 == s && $1 != s {print $1}'); do kill -9 "$p" 2>/dev/null; done
    sleep 2
done
exit 1
SH
)
write_service ray-head <<EOF
$RAY_ENV
ray_start() {
$RETRY_START
}
# A head killed with SIGKILL leaves its temp folder's ray_current_cluster: with it, and a node of the old
# cluster still running on this host (its processes carry --gcs-address=<this port>), a relaunched head
# refuses to start ("Ray is trying to start at ..., but is already running at ..."). The head is new.
rm -f "$DIR/ray/ray_current_cluster"
ray_start "$BIN/ray" start --head --block --node-ip-address=127.0.0.1 --port=$GCS_PORT \
    --ray-client-server-port=$CLIENT_PORT --include-dashboard=false --num-cpus=1 \
    --object-store-memory=$OBJ_STORE --temp-dir="$DIR/ray" $(ray_ports) --disable-usage-stats
EOF
launch ray-head
# The worker node is supervised, as a real deployment's node is (systemd Restart=always, a Kubernetes pod):
# a new head is a new cluster (no GCS fault tolerance without Redis), which the running raylet never joins;
# and a node that joins while the head is down waits forever ("Failed to get cluster ID from GCS"). So:
# wait until the head's GCS port accepts connections, join, and whenever the node stops or the head's port
# has refused connections for 20 s, stop what is left of the node and start over (it rejoins a relaunched
# head by itself, ~10-30 s after the head is back).
SUPERVISE=$(cat <<'SH'
gcs_up() { (exec 3<>"/dev/tcp/127.0.0.1/$GCS_PORT") 2>/dev/null; }
stop_node() { for p in $(ps -eo pid=,sid= | awk -v s=$$ '$2 == s && $1 != s {print $1}'); do kill -9 "$p" 2>/dev/null; done; }
trap 'stop_node; exit 0' TERM INT
while true; do
    until gcs_up; do sleep 1; done
    "$@" &
    node=$!
    down=0
    while kill -0 "$node" 2>/dev/null; do
        sleep 2
        if gcs_up; then down=0; else down=$((down + 2)); fi
        if (( down >= 20 )); then echo "[ray] the head at 127.0.0.1:$GCS_PORT is unreachable for 20 s: leaving its cluster" >&2; break; fi
    done
    echo "[ray] node stopped: rejoining when the head answers" >&2
    stop_node
    wait "$node" 2>/dev/null
    sleep 2
done
SH
)
write_service ray-worker <<EOF
$RAY_ENV
GCS_PORT=$GCS_PORT
supervise() {
$SUPERVISE
}
# (--include-log-monitor=false: the head's log monitor reads the log folder both nodes share, this host's; a second
# one read every file again and published every line twice)
supervise "$BIN/ray" start --block --address=127.0.0.1:$GCS_PORT --node-ip-address=127.0.0.1 --num-cpus=1 \
    --object-store-memory=$OBJ_STORE $(ray_ports) --disable-usage-stats --include-log-monitor=false
EOF

# The head must accept the second node: its GCS answers once `ray start --head` is done.
ray_up() { RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$RAY_TOKEN "$PY" - "$GCS_PORT" "$1" <<'PY'
import sys, ray
ray.init(address=f"127.0.0.1:{sys.argv[1]}", logging_level="ERROR", log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
sys.exit(0 if len(alive) >= int(sys.argv[2]) else 1)
PY
}
wait_for "the Ray head on port $GCS_PORT" "$RAY_WAIT" ray_up 1
launch ray-worker
log "Ray head up on 127.0.0.1:$GCS_PORT ($(elapsed)s)"

# Both boot at once: the Prefect server (migrations on a new database) and the second Ray node.
wait_for "the Prefect API at $API" 180 curl -fsS -o /dev/null --max-time 2 "$API/health"
log "Prefect server up at $API ($(elapsed)s)"

# ---------------------------------------------------------------------------------------------
# 5. S3 ready (radosgw started in the background above); the stack's bucket.
# ---------------------------------------------------------------------------------------------
S3_LINES=""
if [[ "${CJE_STACK_NO_RGW:-0}" != 1 ]]; then
    wait "$RGW_JOB" || die "radosgw did not start (see $DIR/rgw)"
    S3_LINES=$(grep -v '^#' "$RGW_ENV")
    while read -r n p; do echo "rgw-$n $p" >> "$PIDS"; done < "$DIR/rgw/pids"
    log "radosgw up ($(elapsed)s)"
fi

# ---------------------------------------------------------------------------------------------
# 6. Work pool and worker; the worker's flow runs get the cluster and storage settings.
# ---------------------------------------------------------------------------------------------
PREFECT_API_URL="$API" "$BIN/prefect" --no-prompt work-pool create "$POOL" --type process --overwrite >/dev/null
{
    echo "PREFECT_API_URL=$API"
    echo "CJE_STACK_POOL=$POOL"
    echo "RAY_ADDRESS=ray://127.0.0.1:$CLIENT_PORT"
    echo "CJE_STACK_RAY_GCS=127.0.0.1:$GCS_PORT"
    echo "RAY_AUTH_MODE=token"
    echo "RAY_AUTH_TOKEN=$RAY_TOKEN"
    echo "CJE_S3_CONDITIONAL_WRITES=native"
    # Every shared state goes into the cluster over the direct path (ray_fanout.put_shared).
    echo "CJE_RAY_DIRECT_PUT_MIN_BYTES=1"
    # Flow runs ride out an API restart (the client retries connection errors with backoff).
    echo "PREFECT_CLIENT_MAX_RETRIES=8"
    # ... and a PostgreSQL restart: while the database refuses connections the Prefect server answers 500, not
    # 503 (its retryable-error test knows DBAPIError, not the ConnectionRefusedError of a new connection), and a
    # flow run whose set_state or task-run creation got that 500 crashed (exit 1; seen in the chaos soak).
    echo "PREFECT_CLIENT_RETRY_EXTRA_CODES=500"
    [[ -n "$S3_LINES" ]] && echo "$S3_LINES"
} > "$DIR/service.env"
write_service prefect-worker <<EOF
set -a; . "$DIR/service.env"; set +a
export DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0 PREFECT_HOME="$DIR/prefect-worker-\${CJE_WORKER_NAME:-worker-1}"
# Flow runs import the deployments' entrypoints (module paths) from the checkout this stack was started from,
# as the Ray nodes do, also when the venv's editable install points at another checkout.
export PYTHONPATH="$ROOT\${PYTHONPATH:+:\$PYTHONPATH}"
# Flow runs send heartbeats: a run whose worker died is marked Crashed (cje deploy's automation).
export PREFECT_FLOWS_HEARTBEAT_FREQUENCY=\${PREFECT_FLOWS_HEARTBEAT_FREQUENCY:-30}
# It asks for due runs every 2 s (the default 10 s adds up to 10 s to each of the tier's ~40 runs).
export PREFECT_WORKER_QUERY_SECONDS=\${PREFECT_WORKER_QUERY_SECONDS:-2}
exec "$BIN/prefect" worker start --pool "$POOL" --name "\${CJE_WORKER_NAME:-worker-1}" \
    --type process --prefetch-seconds 5
EOF
launch prefect-worker
wait_for "the Ray worker node" "$RAY_WAIT" ray_up 2
log "Ray worker node joined ($(elapsed)s)"

# ---------------------------------------------------------------------------------------------
# 7. The env file, written atomically once everything answers.
# ---------------------------------------------------------------------------------------------
tmp="$ENV_FILE.tmp.$$"
{
    echo "# written by infra/stack/start.sh; loopback test stack (stop: bash infra/stack/stop.sh)"
    cat "$DIR/service.env"
    echo "CJE_STACK_PG_URL=$PG_URL"
    echo "CJE_STACK_DIR=$DIR"
    echo "CJE_STACK_PIDS=$PIDS"
    echo "CJE_STACK_RUN=$DIR/run"
    echo "CJE_STACK_LOGS=$DIR/logs"
    echo "CJE_STACK_STARTUP_S=$(elapsed)"
} > "$tmp"
mv "$tmp" "$ENV_FILE"
STARTED=1
rm -f "$STARTER"
log "stack up in $(elapsed)s (env $ENV_FILE)"
echo "$ENV_FILE"
