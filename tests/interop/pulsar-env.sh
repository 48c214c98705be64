#!/usr/bin/env bash
# Prepares pulsar-client (PyPI, the C++-based official Python client), the other people's
# Pulsar client the Pulsar interop test drives, in a venv cached at
# ~/.cache/onceflow/venv-pulsar-interop so later runs install nothing.
# Prints a `PYTHON=...` line for the caller. The version is pinned below; a cached venv is
# rebuilt when it changes.
set -euo pipefail
CACHE=${ONCEFLOW_CACHE_DIR:-$HOME/.cache/onceflow}
VENV="$CACHE/venv-pulsar-interop"
PY_REQS="pulsar-client==3.13.0"
log() { printf '[interop] %s\n' "$*" >&2; }
mkdir -p "$CACHE"
# One installer at a time (tests run in parallel).
exec 9>"$CACHE/.venv-pulsar-interop.lock"
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
