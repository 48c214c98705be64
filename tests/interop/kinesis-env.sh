#!/usr/bin/env bash
# Prepares boto3 (PyPI), AWS's own Python SDK, for the Kinesis interop test, in a venv cached
# at ~/.cache/onceflow/venv-kinesis-interop so later runs install nothing. Prints a
# `PYTHON=...` line for the caller. The version is pinned below; a cached venv is rebuilt when
# it changes.
set -euo pipefail
CACHE=${ONCEFLOW_CACHE_DIR:-$HOME/.cache/onceflow}
VENV="$CACHE/venv-kinesis-interop"
PY_REQS="boto3==1.44.5"
log() { printf '[interop] %s\n' "$*" >&2; }
mkdir -p "$CACHE"
# One installer at a time (tests run in parallel).
exec 9>"$CACHE/.venv-kinesis-interop.lock"
flock 9
if [[ ! -f $VENV/.reqs || $(<"$VENV/.reqs") != "$PY_REQS" ]]; then
    log "creating $VENV ($PY_REQS)"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet --disable-pip-version-check $PY_REQS >&2
    "$VENV/bin/pip" freeze >"$VENV/versions.txt"
    echo "$PY_REQS" >"$VENV/.reqs"
fi
echo "PYTHON=$VENV/bin/python"
