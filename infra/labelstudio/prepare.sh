#!/usr/bin/env bash
# Prepare Label Studio without leaving it running: its virtualenv and the migrated database template
# that infra/labelstudio/start.sh reuses (a fresh database takes minutes of migrations). .ci/run runs
# this in the background beside its own install, so the later start, just before the service tier,
# takes seconds. The server started here has its own state directory and is stopped before exit,
# also on failure or interruption.
#
#   bash infra/labelstudio/prepare.sh     # exit 0 when the template exists afterwards
#
# Environment: CJE_LS_VENV as for start.sh; CJE_LS_PREP_DIR state directory of the throw-away
# server (default /tmp/cje-labelstudio-prepare).
set -Eeuo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
export CJE_LS_DIR="${CJE_LS_PREP_DIR:-/tmp/cje-labelstudio-prepare}"
export CJE_LS_ENV="$CJE_LS_DIR/env"
trap 'bash "$HERE/stop.sh" >/dev/null 2>&1 || true' EXIT
trap 'exit 143' TERM INT
bash "$HERE/start.sh" >/dev/null
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${CJE_LS_VENV:-$REPO/.venv-labelstudio}"
ls "$VENV"/.cje-template-*.sqlite3 >/dev/null 2>&1 || { echo "[labelstudio] no migrated template in $VENV" >&2; exit 1; }
echo "[labelstudio] prepared: virtualenv $VENV and its migrated database template" >&2
