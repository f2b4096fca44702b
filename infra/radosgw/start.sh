#!/usr/bin/env bash
# Start a throw-away one-node Ceph (monitor + memstore OSD + RADOS gateway) on loopback, for the
# real-S3 integration tier. Everything lives in one state directory and in memory; nothing is
# installed as a service and nothing listens outside 127.0.0.1.
#
#   bash infra/radosgw/start.sh        # prints the env file path; tests read it
#   bash infra/radosgw/stop.sh         # kills exactly the PIDs recorded here, removes the state
#
# Environment (all optional):
#   CJE_RGW_DIR   state directory (ceph.conf, logs, mon store, pids)   default /tmp/cje-rgw
#   CJE_RGW_ENV   env file written for the tests                        default $CJE_RGW_DIR/env
#   CJE_RGW_PORT  S3 port on 127.0.0.1                                  default: a free port
#   CJE_RGW_MEM   memstore size in bytes (RAM is only used as filled)   default 4 GiB
#
# The env file holds shell-style assignments: CJE_RGW_ENDPOINT, AWS_ENDPOINT_URL, CJE_S3_ENDPOINT,
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_REQUEST_CHECKSUM_CALCULATION,
# AWS_RESPONSE_CHECKSUM_VALIDATION, and CJE_RGW_SERVICE_{USER,ACCESS_KEY,SECRET_KEY} (a second,
# unprivileged user). The keys are fixed test keys for a loopback-only server.
set -Eeuo pipefail

DIR="${CJE_RGW_DIR:-/tmp/cje-rgw}"
ENV_FILE="${CJE_RGW_ENV:-$DIR/env}"
MEM_BYTES="${CJE_RGW_MEM:-4294967296}"
ACCESS_KEY="cjetestaccesskey0001"
SECRET_KEY="cjetestsecretkey0000000000000000000000001"
RGW_UID="cje-test"
# A second, unprivileged user for bucket-policy tests (infra/bucket-policy.json names it as
# principal arn:aws:iam:::user/cje-service on radosgw).
SVC_UID="cje-service"
SVC_ACCESS_KEY="cjeserviceaccesskey1"
SVC_SECRET_KEY="cjeservicesecretkey000000000000000000001"
T0=$(date +%s.%N)

log() { echo "[radosgw] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---------------------------------------------------------------------------------------------
# 0. Already running? (idempotent: a second start reuses a live gateway)
# ---------------------------------------------------------------------------------------------
if [[ -f "$DIR/pids" && -f "$ENV_FILE" ]]; then
    alive=1
    while read -r name pid; do
        [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || alive=0
    done < "$DIR/pids"
    if [[ $alive == 1 ]]; then
        # shellcheck disable=SC1090
        endpoint=$(. "$ENV_FILE"; echo "$CJE_RGW_ENDPOINT")
        if curl -fsS -o /dev/null --max-time 3 "$endpoint/"; then
            log "already running at $endpoint (env file $ENV_FILE)"
            echo "$ENV_FILE"
            exit 0
        fi
    fi
    log "stale state in $DIR: stopping it first"
    bash "$(dirname "$0")/stop.sh" >/dev/null 2>&1 || true
fi

# ---------------------------------------------------------------------------------------------
# 1. Install the Ceph daemons if missing (Debian packages; quiet; needs root or sudo).
# ---------------------------------------------------------------------------------------------
missing() {
    local b
    for b in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool ceph-authtool curl; do
        command -v "$b" >/dev/null 2>&1 || return 0
    done
    return 1
}
# Two stacks may start at once (.ci/run starts a second one for the fault tests): one apt-get at a time (dpkg
# takes its lock without waiting), and the second finds the packages the first installed.
if missing; then
    exec 9> /tmp/cje-apt.lock
    flock 9
fi
if missing; then
    SUDO=""
    [[ $(id -u) != 0 ]] && SUDO="sudo"
    log "installing radosgw ceph-mon ceph-osd (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine has empty package lists: update once, then install.
    $SUDO apt-get update -qq >/dev/null || die "apt-get update failed"
    $SUDO apt-get install -y -qq --no-install-recommends \
        radosgw ceph-mon ceph-osd ceph-common curl >/dev/null \
        || die "apt-get install radosgw ceph-mon ceph-osd ceph-common failed"
fi
exec 9>&-  # the apt lock, if this script took it (closing a closed descriptor is no error)

# Where the Ceph plugins (erasure code, compressors, crypto) and OSD object classes were unpacked.
LIBCEPH=""
for cand in /usr/lib/"$(uname -m)"-linux-gnu /usr/lib64 /usr/lib; do
    if [[ -d "$cand/ceph/erasure-code" && -d "$cand/rados-classes" ]]; then LIBCEPH="$cand"; break; fi
done
[[ -n "$LIBCEPH" ]] || die "cannot find ceph/erasure-code and rados-classes under /usr/lib*"

# ---------------------------------------------------------------------------------------------
# 2. Fresh state directory and free loopback ports.
# ---------------------------------------------------------------------------------------------
rm -rf "$DIR"
mkdir -p "$DIR"/{mon.a,osd.0,run} "$(dirname "$ENV_FILE")"

free_port() {  # below the ephemeral range, so no outgoing connection takes it before its service binds it
    python3 "$(dirname "$0")/../free_port.py"
}
MON_PORT=$(free_port)
RGW_PORT="${CJE_RGW_PORT:-$(free_port)}"
FSID=$(uuidgen)
OSD_UUID=$(uuidgen)
CONF="$DIR/ceph.conf"

cat > "$CONF" <<EOF
[global]
fsid = $FSID
mon_host = v2:127.0.0.1:$MON_PORT
public_network = 127.0.0.0/8
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
auth_allow_insecure_global_id_reclaim = true
# auth "none" has no session key, so only "crc" connection mode works; radosgw asks for
# "secure" towards the monitor by default and would fail with -13 (EACCES) without this.
ms_mon_client_mode = crc
ms_mon_service_mode = crc
ms_mon_cluster_mode = crc
ms_client_mode = crc
ms_service_mode = crc
ms_cluster_mode = crc
ms_bind_ipv6 = false
# plugins and object classes from the unpacked Debian libraries
plugin_dir = $LIBCEPH/ceph
erasure_code_dir = $LIBCEPH/ceph/erasure-code
osd_class_dir = $LIBCEPH/rados-classes
osd_class_load_list = *
osd_class_default_list = *
# one OSD: pools of size 1, few PGs, chooseleaf over OSDs
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
mon_max_pg_per_osd = 1000
osd_crush_chooseleaf_type = 0
mon_warn_on_pool_no_redundancy = false
run_dir = $DIR/run
admin_socket = $DIR/run/\$name.asok
log_file = $DIR/\$name.log
keyring = $DIR/keyring
log_to_stderr = false
err_to_stderr = false
debug_ms = 0
$( [[ "${CJE_RGW_DEBUG:-0}" == 1 ]] && printf 'debug_monc = 20\ndebug_auth = 20\ndebug_rgw = 20\n' )

[mon]
mon_data = $DIR/mon.\$id
mon_allow_pool_delete = true
mon_cluster_log_file = $DIR/cluster.log

[osd]
osd_data = $DIR/osd.\$id
osd_objectstore = memstore
memstore_device_bytes = $MEM_BYTES
osd_crush_update_on_start = false
osd_class_update_on_start = false
osd_max_object_name_len = 460
osd_max_object_namespace_len = 64

[client.rgw.a]
rgw_frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw_data = $DIR/rgw
rgw_dns_name = 127.0.0.1
rgw_enable_usage_log = false
rgw_crypt_require_ssl = false
EOF

C=(-c "$CONF")
PIDS="$DIR/pids"
: > "$PIDS"

start_daemon() {  # name, command... ; runs in the foreground of a new session, records its PID
    local name=$1; shift
    setsid "$@" -f > "$DIR/$name.out" 2>&1 < /dev/null &
    local pid=$!
    echo "$name $pid" >> "$PIDS"
}

on_error() {
    log "start failed; last log lines:"
    for f in "$DIR"/*.log "$DIR"/*.out; do
        [[ -s "$f" ]] && { echo "== $f" >&2; tail -n 15 "$f" >&2; }
    done
    CJE_RGW_KEEP_LOGS=1 bash "$(dirname "$0")/stop.sh" >/dev/null 2>&1 || true
    log "daemons stopped; logs kept in $DIR"
}
STARTED=0
trap '[[ $STARTED == 1 ]] || on_error' EXIT

wait_for() {  # description, timeout seconds, command...
    local what=$1 timeout=$2; shift 2
    local deadline=$(( $(date +%s) + timeout ))
    until "$@" >/dev/null 2>&1; do
        if (( $(date +%s) >= deadline )); then log "timed out after ${timeout}s waiting for $what"; return 1; fi
        sleep 0.2
    done
}

# ---------------------------------------------------------------------------------------------
# 3. Monitor.
# ---------------------------------------------------------------------------------------------
ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT]" "$DIR/monmap" >/dev/null
ceph-mon "${C[@]}" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring" >/dev/null 2>&1
start_daemon mon.a ceph-mon "${C[@]}" -i a
wait_for "the monitor" 30 timeout 5 ceph "${C[@]}" --connect-timeout 3 mon stat

# ---------------------------------------------------------------------------------------------
# 4. One memstore OSD, placed in the CRUSH map by hand (osd_crush_update_on_start = false).
# ---------------------------------------------------------------------------------------------
OSD_ID=$(ceph "${C[@]}" osd new "$OSD_UUID")
[[ "$OSD_ID" == 0 ]] || die "expected osd id 0, got '$OSD_ID'"
ceph-osd "${C[@]}" -i 0 --mkfs --osd-uuid "$OSD_UUID" >/dev/null 2>&1
ceph "${C[@]}" osd crush add osd.0 1.0 root=default >/dev/null 2>&1
start_daemon osd.0 ceph-osd "${C[@]}" -i 0
osd_up() { ceph "${C[@]}" osd dump 2>/dev/null | grep -q '^osd\.0 up'; }
wait_for "osd.0 up" 60 osd_up

# ---------------------------------------------------------------------------------------------
# 5. Gateway, then the S3 user with fixed test keys.
# ---------------------------------------------------------------------------------------------
mkdir -p "$DIR/rgw"
start_daemon rgw.a radosgw "${C[@]}" -n client.rgw.a
ENDPOINT="http://127.0.0.1:$RGW_PORT"
wait_for "the gateway on $ENDPOINT" ${CJE_RGW_TIMEOUT:-90} curl -fsS -o /dev/null --max-time 3 "$ENDPOINT/"
radosgw-admin "${C[@]}" user create --uid="$RGW_UID" --display-name="CJE integration tests" \
    --access-key="$ACCESS_KEY" --secret-key="$SECRET_KEY" >/dev/null 2>&1 \
    || die "radosgw-admin user create failed"
radosgw-admin "${C[@]}" user create --uid="$SVC_UID" --display-name="CJE service (policy tests)" \
    --access-key="$SVC_ACCESS_KEY" --secret-key="$SVC_SECRET_KEY" >/dev/null 2>&1 \
    || die "radosgw-admin user create $SVC_UID failed"

# ---------------------------------------------------------------------------------------------
# 6. The env file the tests read, written atomically once S3 answers.
# ---------------------------------------------------------------------------------------------
tmp="$ENV_FILE.tmp.$$"
cat > "$tmp" <<EOF
# written by infra/radosgw/start.sh; loopback test gateway, fixed test keys
CJE_RGW_ENDPOINT=$ENDPOINT
AWS_ENDPOINT_URL=$ENDPOINT
CJE_S3_ENDPOINT=$ENDPOINT
AWS_ACCESS_KEY_ID=$ACCESS_KEY
AWS_SECRET_ACCESS_KEY=$SECRET_KEY
AWS_REGION=us-east-1
AWS_REQUEST_CHECKSUM_CALCULATION=when_required
AWS_RESPONSE_CHECKSUM_VALIDATION=when_required
CJE_RGW_DIR=$DIR
CJE_RGW_SERVICE_USER=$SVC_UID
CJE_RGW_SERVICE_ACCESS_KEY=$SVC_ACCESS_KEY
CJE_RGW_SERVICE_SECRET_KEY=$SVC_SECRET_KEY
EOF
mv "$tmp" "$ENV_FILE"
STARTED=1

T1=$(date +%s.%N)
secs=$(python3 -c "print(f'{$T1 - $T0:.1f}')")
log "S3 gateway up at $ENDPOINT in ${secs}s (state $DIR, env $ENV_FILE)"
echo "$ENV_FILE"
