#!/usr/bin/env bash
# Create a SEPARATE virtualenv holding the reference package (cje-eval, the CJE authors' implementation)
# for the side-by-side speed benchmark. It lives in benchmarks/_work/refvenv (git-ignored) and is never
# installed into the project's own .venv.
#
# Usage: bash benchmarks/reference_env.sh            (from the repository root or anywhere)
#        CJE_REF_VERSION=0.9.3 PYTHON=python3.11 bash benchmarks/reference_env.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/_work/refvenv"
PY="${PYTHON:-python3.11}"
VERSION="${CJE_REF_VERSION:-0.9.3}"
mkdir -p "$HERE/_work"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "cje-eval==$VERSION"
"$VENV/bin/python" -c "import importlib.metadata as m; print('cje-eval', m.version('cje-eval'), 'in $VENV')"
