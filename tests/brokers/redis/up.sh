#!/usr/bin/env bash
# Redis (Debian's redis-server) on 127.0.0.1:${ONCEFLOW_REDIS_PORT:-16379}, AOF on
# (appendonly yes, appendfsync everysec: a write is in the file before its reply is sent, so
# it survives a restart of redis-server). The default user needs no password (the URL
# printed); an ACL user onceflow/onceflow exists so tests can check wrong credentials.
# Our own process: the package's service, if any, does not matter.
# ONCEFLOW_KEEP_DATA=1 keeps the data of the last run (restart.sh uses it).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SERVICE=redis
PORT=${ONCEFLOW_REDIS_PORT:-16379}
URL="redis://127.0.0.1:$PORT"

probe() {
    [[ $(timeout 3 redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null) == PONG ]]
}

already_up redis probe && exit 0

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    apt_install redis-server
fi
port_in_use "$PORT" && die "port $PORT is taken by a process we did not start"

if [[ ${ONCEFLOW_KEEP_DATA:-} == 1 && -d $RUN_DIR/redis-data ]]; then
    data=$RUN_DIR/redis-data
else
    data=$(fresh_data_dir redis)
fi
log "starting $(redis-server --version | awk '{print $1, $2, $3}') on 127.0.0.1:$PORT"
start_bg redis redis-server --port "$PORT" --bind 127.0.0.1 --protected-mode yes \
    --dir "$data" --save "" --appendonly yes --appendfsync everysec --daemonize no \
    --logfile "" --user onceflow on '>onceflow' '~*' '&*' '+@all'
wait_until 30 probe || die "redis did not answer PING on port $PORT"
emit_env redis "ONCEFLOW_REDIS_URL=$URL"
