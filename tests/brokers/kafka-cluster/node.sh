#!/usr/bin/env bash
# One node of the Kafka cluster started by up.sh, for the fault tests:
#   node.sh kill N      SIGKILL node N (1..3) and wait until it is gone
#   node.sh start N     start node N again on its data (waits until it answers ApiVersions)
#   node.sh restart N   both
#   node.sh pid N       print node N's pid (fails if it is not running)
# Progress on stderr; nothing on stdout but `pid`'s answer.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cmd=${1:-} n=${2:-}
[[ $n =~ ^[1-3]$ ]] || { log "usage: node.sh kill|start|restart|pid N (N = 1..3)"; exit 2; }
SERVICE=kafka-cluster-$n

start() {
    if is_running "kafka-cluster-$n"; then
        log "kafka-cluster-$n already running"
        return 0
    fi
    port_in_use "$(node_port "$n")" && die "port $(node_port "$n") is taken"
    log "starting kafka-cluster-$n"
    start_node "$n"
    wait_until 90 api_versions "$(node_port "$n")" || die "kafka-cluster-$n does not answer"
}

case $cmd in
kill) log "SIGKILL kafka-cluster-$n"; kill_node "$n" ;;
start) start ;;
restart) kill_node "$n"; start ;;
pid) service_pid "kafka-cluster-$n" ;;
*) log "usage: node.sh kill|start|restart|pid N"; exit 2 ;;
esac
