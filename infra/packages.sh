#!/usr/bin/env bash
# The Debian packages the test tiers use, installed in one apt-get: Chromium (the monitoring pages checked
# offline, tests/flows/test_monitoring.py), PostgreSQL (infra/stack/start.sh) and Ceph's radosgw
# (infra/radosgw/start.sh). Those start scripts install what they need themselves when it is missing; .ci/run
# runs this at its start, in the background beside its pip installs, so that no apt-get is left for the stack
# starts after the default tier (on a fresh CI machine the Ceph packages were installed there, serially).
#
#   bash infra/packages.sh     # exit 0 when every package's command is there afterwards
#
# Nothing is done when every command is already there. One apt-get at a time: the start scripts take the same
# lock (/tmp/cje-apt.lock). Needs root or sudo.
set -Eeuo pipefail

log() { echo "[packages] $*" >&2; }
T0=$(date +%s)

# package -> a command it provides (PostgreSQL's server binaries are not on PATH: checked by folder). Installed
# as the start scripts install them: Chromium and PostgreSQL with their recommended packages, Ceph without.
declare -A NEEDS=([chromium]=chromium [radosgw]=radosgw [ceph-mon]=ceph-mon [ceph-osd]=ceph-osd
                  [ceph-common]=ceph [curl]=curl)
WITH_RECOMMENDS=" chromium postgresql "
missing() {
    local p
    MISSING=()
    for p in "${!NEEDS[@]}"; do
        command -v "${NEEDS[$p]}" >/dev/null 2>&1 || MISSING+=("$p")
    done
    ls -d /usr/lib/postgresql/*/bin >/dev/null 2>&1 || MISSING+=(postgresql)
    (( ${#MISSING[@]} > 0 ))
}

missing || { log "every package is installed"; exit 0; }
exec 9> /tmp/cje-apt.lock
flock 9
if missing; then
    SUDO=""
    [[ $(id -u) != 0 ]] && SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    PLAIN=() BARE=()
    for p in "${MISSING[@]}"; do
        if [[ "$WITH_RECOMMENDS" == *" $p "* ]]; then PLAIN+=("$p"); else BARE+=("$p"); fi
    done
    log "installing ${MISSING[*]} (apt-get)"
    $SUDO apt-get update -qq >/dev/null || { log "ERROR: apt-get update failed"; exit 1; }
    if (( ${#PLAIN[@]} > 0 )); then
        $SUDO apt-get install -y -qq "${PLAIN[@]}" >/dev/null \
            || { log "ERROR: apt-get install ${PLAIN[*]} failed"; exit 1; }
    fi
    if (( ${#BARE[@]} > 0 )); then
        $SUDO apt-get install -y -qq --no-install-recommends "${BARE[@]}" >/dev/null \
            || { log "ERROR: apt-get install ${BARE[*]} failed"; exit 1; }
    fi
fi
if missing; then
    log "ERROR: still missing after apt-get: ${MISSING[*]}"
    exit 1
fi
log "installed in $(( $(date +%s) - T0 )) s"
