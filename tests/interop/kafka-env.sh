#!/usr/bin/env bash
# Prepares the other people's Kafka clients the interop tests drive, cached so later runs
# install nothing:
#   - a Python venv with confluent-kafka, opentelemetry-sdk and
#     opentelemetry-instrumentation-confluent-kafka (PyPI) in ~/.cache/onceflow/venv-kafka-interop
#   - kafkajs (npm registry) in ~/.cache/onceflow/node-kafka-interop
# Prints `PYTHON=...` and `NODE_PATH=...` lines for the caller. Versions are pinned below so a
# cached environment is rebuilt when they change.
set -euo pipefail
CACHE=${ONCEFLOW_CACHE_DIR:-$HOME/.cache/onceflow}
VENV="$CACHE/venv-kafka-interop"
NODE_DIR="$CACHE/node-kafka-interop"
PY_REQS="confluent-kafka==2.16.1 opentelemetry-instrumentation-confluent-kafka==0.66b1 opentelemetry-sdk~=1.45.0"
NODE_REQS="kafkajs@2.2.4"
log() { printf '[interop] %s\n' "$*" >&2; }
mkdir -p "$CACHE"

if [[ ! -f $VENV/.reqs || $(<"$VENV/.reqs") != "$PY_REQS" ]]; then
    log "creating $VENV ($PY_REQS)"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet --disable-pip-version-check $PY_REQS >&2
    "$VENV/bin/pip" freeze >"$VENV/versions.txt"
    echo "$PY_REQS" >"$VENV/.reqs"
fi

if [[ ! -f $NODE_DIR/.reqs || $(<"$NODE_DIR/.reqs") != "$NODE_REQS" ]]; then
    log "installing $NODE_REQS into $NODE_DIR"
    rm -rf "$NODE_DIR"
    mkdir -p "$NODE_DIR"
    (cd "$NODE_DIR" && echo '{"name":"onceflow-kafka-interop","private":true}' >package.json &&
        npm install --silent --no-audit --no-fund "$NODE_REQS" >&2)
    echo "$NODE_REQS" >"$NODE_DIR/.reqs"
fi

echo "PYTHON=$VENV/bin/python"
echo "NODE_PATH=$NODE_DIR/node_modules"
