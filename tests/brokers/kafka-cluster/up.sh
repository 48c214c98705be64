#!/usr/bin/env bash
# A 3-node Apache Kafka KRaft cluster (combined broker+controller nodes) on loopback, for the
# fault tests (tests/tests/faults_kafka_cluster.rs): replication factor 3 and
# min.insync.replicas 2 for data, offsets and transaction state (ports and settings in
# common.sh). Ready when every node answers and a topic with replication factor 3 can be
# created. Prints ONCEFLOW_KAFKA_CLUSTER_URL (all three bootstrap servers) and
# ONCEFLOW_KAFKA_CLUSTER_NODE (node.sh: `node.sh kill|start|restart N`), and for the
# network-fault tests ONCEFLOW_KAFKA_CLUSTER_FAULT_URL (the three fault-proxy addresses the FAULT
# listeners advertise, in node order) and ONCEFLOW_KAFKA_CLUSTER_FAULT_UPSTREAMS (the FAULT
# listeners each proxy relays to, same order).
# Stop: tests/brokers/down.sh kafka-cluster (its nodes kafka-cluster-1..3).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SERVICE=kafka-cluster
HERE="$BROKERS_DIR/kafka-cluster"

all_answer() {
    local n
    for n in "${NODES[@]}"; do
        is_running "kafka-cluster-$n" && api_versions "$(node_port "$n")" || return 1
    done
}

env_lines() {
    emit_env kafka-cluster "ONCEFLOW_KAFKA_CLUSTER_URL=kafka://$(bootstrap)" \
        "ONCEFLOW_KAFKA_CLUSTER_NODE=$HERE/node.sh" \
        "ONCEFLOW_KAFKA_CLUSTER_FAULT_URL=kafka://$(joined node_fault_proxy_port)" \
        "ONCEFLOW_KAFKA_CLUSTER_FAULT_UPSTREAMS=$(joined node_fault_port)"
}

if all_answer 2>/dev/null && [[ -s $RUN_DIR/kafka-cluster.env ]]; then
    log "kafka-cluster already running"
    # Written again, not replayed: the node script named must be this checkout's (a cluster
    # started from another clone, since deleted, would name a script that no longer exists).
    env_lines
    exit 0
fi
for n in "${NODES[@]}"; do stop_service "kafka-cluster-$n" 2>/dev/null || true; done

version=$(kafka_libs)
for n in "${NODES[@]}"; do
    for p in "$(node_port "$n")" "$(node_controller_port "$n")" "$(node_fault_port "$n")"; do
        port_in_use "$p" && die "port $p is taken by a process we did not start"
    done
done

# One cluster id (16 random bytes, URL-safe base64, not starting with '-') for all nodes.
cluster_id=-
while [[ $cluster_id == -* ]]; do
    cluster_id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')
done
log "formatting Kafka $version storage of 3 nodes"
for n in "${NODES[@]}"; do
    fresh_data_dir "kafka-cluster-$n" >/dev/null
    rm -rf "$RUN_DIR/kafka-cluster-$n-tmp"
    props=$(write_node_props "$n")
    tool kafka.tools.StorageTool format --cluster-id "$cluster_id" --config "$props" \
        >"$RUN_DIR/kafka-cluster-format.log" 2>&1 ||
        { cat "$RUN_DIR/kafka-cluster-format.log" >&2; die "kafka storage format of node $n failed"; }
done

stop_all() {
    local n
    for n in "${NODES[@]}"; do STOP_TIMEOUT_S=5 stop_service "kafka-cluster-$n"; done
}
fail() {
    local n
    for n in "${NODES[@]}"; do
        is_running "kafka-cluster-$n" || log "kafka-cluster-$n exited"
        log "last lines of $RUN_DIR/kafka-cluster-$n.log:"
        tail -n 15 "$RUN_DIR/kafka-cluster-$n.log" >&2 || true
    done
    stop_all
    LAST_STARTED=
    die "$@"
}

log "starting a 3-node Kafka $version cluster on $(bootstrap)"
for n in "${NODES[@]}"; do start_node "$n"; done
LAST_STARTED=
wait_until 120 all_answer || fail "the Kafka cluster does not answer ApiVersions on $(bootstrap)"

# Ready means a controller leader and three unfenced brokers: a topic with replication factor 3
# can be created (retried while the brokers register), then deleted.
probe_topic=__onceflow_cluster_probe
wait_until 90 tool org.apache.kafka.tools.TopicCommand --bootstrap-server "$(bootstrap)" \
    --create --if-not-exists --topic "$probe_topic" --partitions 1 --replication-factor 3 ||
    fail "the Kafka cluster cannot create a topic with replication factor 3"
tool org.apache.kafka.tools.TopicCommand --bootstrap-server "$(bootstrap)" \
    --delete --topic "$probe_topic" >&2 || fail "the Kafka cluster cannot delete a topic"
env_lines
