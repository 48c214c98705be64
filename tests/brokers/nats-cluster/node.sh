#!/usr/bin/env bash
# One node of the NATS cluster started by up.sh, for the fault tests:
#   node.sh kill N      SIGKILL node N (1..3) and wait until it is gone
#   node.sh start N     start node N again on its store (waits until it is healthy)
#   node.sh restart N   both
#   node.sh pid N       print node N's pid (fails if it is not running)
#   node.sh state N     print node N's state for a failing test's message: running or not,
#                       /healthz, and the last JetStream / raft lines of its log (route
#                       connection retries left out)
# Progress on stderr; nothing on stdout but `pid`'s answer.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cmd=${1:-} n=${2:-}
[[ $n =~ ^[1-3]$ ]] || { log "usage: node.sh kill|start|restart|pid|state N (N = 1..3)"; exit 2; }
SERVICE=nats-cluster-$n

start() {
    if is_running "nats-cluster-$n"; then
        log "nats-cluster-$n already running"
        return 0
    fi
    port_in_use "$(node_port "$n")" && die "port $(node_port "$n") is taken"
    log "starting nats-cluster-$n"
    start_node "$n"
    # Healthy means JetStream current on every stream and consumer it holds: after a kill
    # under load (a 2-core CI machine running other suites) that has taken over a minute.
    wait_until "${ONCEFLOW_NATS_CLUSTER_START_WAIT:-240}" node_healthy "$n" ||
        die "nats-cluster-$n not healthy within ${ONCEFLOW_NATS_CLUSTER_START_WAIT:-240} s: $(state)"
}

state() {
    local pid health
    if pid=$(service_pid "nats-cluster-$n"); then echo "nats-cluster-$n: running (pid $pid)"
    else echo "nats-cluster-$n: not running"; fi
    health=$(curl -sS --max-time 2 "http://127.0.0.1:$(node_monitor_port "$n")/healthz" 2>&1) || true
    echo "  healthz: $health"
    echo "  log (last JetStream/raft lines):"
    grep -vE 'Error trying to connect to route|connection refused' \
        "$RUN_DIR/nats-cluster-$n.log" 2>/dev/null | grep -E 'JetStream|RAFT|raft|leader|WRN|ERR' |
        tail -n 25 | sed 's/^/    /' || true
}

case $cmd in
state) state ;;
kill) log "SIGKILL nats-cluster-$n"; kill_node "$n" ;;
start) start ;;
restart) kill_node "$n"; start ;;
pid) service_pid "nats-cluster-$n" ;;
*) log "usage: node.sh kill|start|restart|pid|state N"; exit 2 ;;
esac
