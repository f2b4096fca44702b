#!/usr/bin/env bash
# Start a throw-away Label Studio on 127.0.0.1 (a free port) for the labelling integration tier.
# It runs from its own virtualenv (its Django dependencies would clash with ours), with SQLite and
# every phone-home off, and writes an env file for the tests.
#
#   bash infra/labelstudio/start.sh      # prints the env file path; tests read it
#   bash infra/labelstudio/stop.sh       # stops exactly the PID recorded here, removes the state
#
# Environment (all optional):
#   CJE_LS_DIR    state directory (data, logs, pid, env)        default /tmp/cje-labelstudio
#   CJE_LS_ENV    env file written for the tests                 default $CJE_LS_DIR/env
#   CJE_LS_VENV   Label Studio's virtualenv                      default <repo>/.venv-labelstudio
#   CJE_LS_PORT   port on 127.0.0.1                              default: a free port
#
# The first start migrates a new SQLite database (minutes on a loaded machine) and keeps a copy,
# $CJE_LS_VENV/.cje-template-<version>.sqlite3; later starts begin from that copy.
#
# The env file holds LABEL_STUDIO_URL, LABEL_STUDIO_API_KEY (a personal access token: a JWT
# refresh token, sent as a Bearer access token after /api/token/refresh/), LABEL_STUDIO_LEGACY_TOKEN
# (sent as 'Token ...'), CJE_LS_PID, and the start-up time and resident memory measured here.
# The user and tokens are fixed test values of a loopback-only server.
set -Eeuo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${CJE_LS_DIR:-/tmp/cje-labelstudio}"
ENV_FILE="${CJE_LS_ENV:-$DIR/env}"
VENV="${CJE_LS_VENV:-$REPO/.venv-labelstudio}"
LS_VERSION="1.23.2"
USER_EMAIL="cje-test@example.com"
USER_PASSWORD="cje-test-password-loopback"
LEGACY_TOKEN="cjelabelstudiotesttoken0000000000000001"
T0=$(date +%s.%N)

log() { echo "[labelstudio] $*" >&2; }
die() {
    log "ERROR: $*"
    [[ -f "$DIR/server.log" ]] && tail -n 30 "$DIR/server.log" >&2
    [[ -f "$DIR/pid" ]] && bash "$HERE/stop.sh" >/dev/null 2>&1   # never leave a half-started server behind
    exit 1
}

# 0. already running? (idempotent)
if [[ -f "$DIR/pid" ]]; then
    pid=$(cat "$DIR/pid")
    url=$([[ -f "$ENV_FILE" ]] && (. "$ENV_FILE"; echo "$LABEL_STUDIO_URL") || true)
    if [[ -n "$url" ]] && kill -0 "$pid" 2>/dev/null && curl -fsS -o /dev/null --max-time 3 "$url/health" 2>/dev/null; then
        log "already running at $url (pid $pid, env file $ENV_FILE)"
        echo "$ENV_FILE"
        exit 0
    fi
    log "stale state in $DIR: stopping it first"
    bash "$HERE/stop.sh" >/dev/null 2>&1 || true
fi

# 1. its own virtualenv (label-studio pins Django, pydantic and friends; ours must not see them)
if [[ ! -x "$VENV/bin/label-studio" ]]; then
    log "installing label-studio==$LS_VERSION into $VENV"
    python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install -q "label-studio==$LS_VERSION" >/dev/null || die "pip install label-studio failed"
fi

# 2. state, port, environment
rm -rf "$DIR"
mkdir -p "$DIR/data"
PORT="${CJE_LS_PORT:-$(python3 "$HERE/../free_port.py")}"  # below the ephemeral range (infra/free_port.py)
URL="http://127.0.0.1:$PORT"
export LABEL_STUDIO_BASE_DATA_DIR="$DIR/data"
export DJANGO_DB=sqlite
export COLLECT_ANALYTICS=false            # no usage analytics
export LATEST_VERSION_CHECK=false          # no call to PyPI for the newest version
export SENTRY_DSN="" FRONTEND_SENTRY_DSN="" # no error reporting
export LABEL_STUDIO_DISABLE_SIGNUP_WITHOUT_LINK=true
export LABEL_STUDIO_HOST="$URL"
export DO_NOT_TRACK=1

# A fresh database takes minutes of migrations; a migrated copy made by an earlier start (same
# version, same fixed test user) is reused when present.
TEMPLATE="$VENV/.cje-template-$LS_VERSION.sqlite3"
if [[ -f "$TEMPLATE" ]]; then
    cp "$TEMPLATE" "$DIR/data/label_studio.sqlite3"
    log "database from the migrated template $TEMPLATE"
fi

# 3. start (own session, so stop.sh can end the whole process group by the recorded PID)
log "starting label-studio $LS_VERSION on $URL (data in $DIR/data)"
setsid "$VENV/bin/label-studio" start --no-browser --internal-host 127.0.0.1 --port "$PORT" \
    --username "$USER_EMAIL" --password "$USER_PASSWORD" --user-token "$LEGACY_TOKEN" \
    --enable-legacy-api-token --data-dir "$DIR/data" >"$DIR/server.log" 2>&1 < /dev/null &
PID=$!
echo "$PID" > "$DIR/pid"

for _ in $(seq 1 600); do
    kill -0 "$PID" 2>/dev/null || die "label-studio exited during start-up"
    if curl -fsS -o /dev/null --max-time 2 "$URL/health" 2>/dev/null; then break; fi
    sleep 0.5
done
curl -fsS -o /dev/null --max-time 2 "$URL/health" || die "label-studio did not answer $URL/health in 300 s"
T1=$(date +%s.%N)

# the migrated database before any personal access token exists (one per user): an online copy
# (SQLite backup API) for the next start
if [[ ! -f "$TEMPLATE" ]]; then
    "$VENV/bin/python" -c 'import sqlite3, sys; s = sqlite3.connect(sys.argv[1]); d = sqlite3.connect(sys.argv[2]); s.backup(d); d.close()' \
        "$DIR/data/label_studio.sqlite3" "$TEMPLATE.tmp" && mv "$TEMPLATE.tmp" "$TEMPLATE" || rm -f "$TEMPLATE.tmp"
fi

# 4. a personal access token (the current kind), made with the legacy token
PAT=$(curl -fsS --max-time 30 -X POST -H "Authorization: Token $LEGACY_TOKEN" "$URL/api/token/" \
      | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["token"])') \
    || die "could not create a personal access token"

# resident memory of the server's process group (kB)
RSS_KB=$(ps -o rss= -g "$(ps -o pgid= -p "$PID" | tr -d ' ')" | awk '{s+=$1} END {print s+0}')
STARTUP_S=$(awk -v a="$T0" -v b="$T1" 'BEGIN {printf "%.1f", b - a}')

umask 077
cat > "$ENV_FILE" <<ENV
# written by infra/labelstudio/start.sh; loopback-only test server
LABEL_STUDIO_URL=$URL
LABEL_STUDIO_API_KEY=$PAT
LABEL_STUDIO_LEGACY_TOKEN=$LEGACY_TOKEN
CJE_LS_PID=$PID
CJE_LS_STARTUP_S=$STARTUP_S
CJE_LS_RSS_KB=$RSS_KB
ENV
log "up at $URL in ${STARTUP_S} s, ${RSS_KB} kB resident (pid $PID); env file $ENV_FILE"
echo "$ENV_FILE"
