#!/usr/bin/env bash
# One node of the NATS cluster started by up.sh, for the fault tests:
#   node.sh kill N      SIGKILL node N (1..3) and wait until it is gone
#   node.sh start N     start node N again on its store (waits until it is healthy)
#   node.sh restart N   both
#   node.sh pid N       print node N's pid (fails if it is not running)
# Progress on stderr; nothing on stdout but `pid`'s answer.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cmd=${1:-} n=${2:-}
[[ $n =~ ^[1-3]$ ]] || { log "usage: node.sh kill|start|restart|pid N (N = 1..3)"; exit 2; }
SERVICE=nats-cluster-$n

start() {
    if is_running "nats-cluster-$n"; then
        log "nats-cluster-$n already running"
        return 0
    fi
    port_in_use "$(node_port "$n")" && die "port $(node_port "$n") is taken"
    log "starting nats-cluster-$n"
    start_node "$n"
    wait_until 60 node_healthy "$n" || die "nats-cluster-$n not healthy"
}

case $cmd in
kill) log "SIGKILL nats-cluster-$n"; kill_node "$n" ;;
start) start ;;
restart) kill_node "$n"; start ;;
pid) service_pid "nats-cluster-$n" ;;
*) log "usage: node.sh kill|start|restart|pid N"; exit 2 ;;
esac
