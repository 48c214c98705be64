# shellcheck shell=bash
# Shared by kafka-cluster/up.sh and kafka-cluster/node.sh: a 3-node Apache Kafka KRaft cluster
# on loopback, each node broker and controller (combined). Node N (1..3) is the service
# `kafka-cluster-N` of lib.sh: pid in $RUN_DIR/kafka-cluster-N.pid, log in
# $RUN_DIR/kafka-cluster-N.log, data in $RUN_DIR/kafka-cluster-N-data (kept across a node's
# restart, fresh at each up.sh start). Same jars as tests/brokers/kafka (its pom.xml, cached in
# $CACHE_DIR/kafka/libs by lib.sh's kafka_libs).
# Ports: broker ${ONCEFLOW_KAFKA_CLUSTER_PORT:-19110}+N, controller
# ${ONCEFLOW_KAFKA_CLUSTER_CONTROLLER_PORT:-19120}+N. Heap per node ${ONCEFLOW_KAFKA_CLUSTER_HEAP:-384m}.
# A second client listener, FAULT, binds ${ONCEFLOW_KAFKA_CLUSTER_FAULT_PORT:-19130}+N and advertises
# ${ONCEFLOW_KAFKA_CLUSTER_FAULT_PROXY_PORT:-19140}+N, where a network-fault test runs one fault proxy
# per node (tests/src/fault_proxy.rs) relaying to the FAULT port: a client bootstrapped on the
# proxy ports stays behind the proxies for every broker. Brokers talk to each other on
# PLAINTEXT, never through the proxies.
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
HEAP=${ONCEFLOW_KAFKA_CLUSTER_HEAP:-384m}
PORT_BASE=${ONCEFLOW_KAFKA_CLUSTER_PORT:-19110}
CONTROLLER_BASE=${ONCEFLOW_KAFKA_CLUSTER_CONTROLLER_PORT:-19120}
FAULT_BASE=${ONCEFLOW_KAFKA_CLUSTER_FAULT_PORT:-19130}
FAULT_PROXY_BASE=${ONCEFLOW_KAFKA_CLUSTER_FAULT_PROXY_PORT:-19140}
NODES=(1 2 3)

node_port() { echo $((PORT_BASE + $1)); }
node_controller_port() { echo $((CONTROLLER_BASE + $1)); }
node_fault_port() { echo $((FAULT_BASE + $1)); }
node_fault_proxy_port() { echo $((FAULT_PROXY_BASE + $1)); }

# joined PORT_FN: 127.0.0.1:<port of node 1>,... for the port function named.
joined() {
    local n b=()
    for n in "${NODES[@]}"; do b+=("127.0.0.1:$("$1" "$n")"); done
    local IFS=,
    echo "${b[*]}"
}

api_versions() { kafka_api_versions "$1"; } # PORT: the broker there answers ApiVersions

bootstrap() { joined node_port; }

# write_node_props N: node N's server.properties (path printed). Replication 3 everywhere,
# min.insync.replicas 2, and failure detection in seconds rather than the defaults' tens of
# seconds: a killed broker is fenced (its partitions' leadership moved) ~3 s after its last
# heartbeat. A restarted broker gets its preferred leaderships back within seconds (not 5 min),
# so leaders and coordinators are spread over the three again before the next kill.
write_node_props() {
    local n=$1 props="$RUN_DIR/kafka-cluster-$1.properties" m voters=()
    for m in "${NODES[@]}"; do voters+=("$m@127.0.0.1:$(node_controller_port "$m")"); done
    local IFS=,
    cat >"$props" <<PROPS
process.roles=broker,controller
node.id=$n
controller.quorum.voters=${voters[*]}
listeners=PLAINTEXT://127.0.0.1:$(node_port "$n"),CONTROLLER://127.0.0.1:$(node_controller_port "$n"),FAULT://127.0.0.1:$(node_fault_port "$n")
advertised.listeners=PLAINTEXT://127.0.0.1:$(node_port "$n"),FAULT://127.0.0.1:$(node_fault_proxy_port "$n")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,FAULT:PLAINTEXT
log.dirs=$RUN_DIR/kafka-cluster-$n-data
num.partitions=1
default.replication.factor=3
min.insync.replicas=2
unclean.leader.election.enable=false
auto.create.topics.enable=true
delete.topic.enable=true
offsets.topic.replication.factor=3
offsets.topic.num.partitions=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
transaction.state.log.num.partitions=3
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
share.coordinator.state.topic.num.partitions=1
group.initial.rebalance.delay.ms=0
broker.heartbeat.interval.ms=500
broker.session.timeout.ms=3000
controller.quorum.election.timeout.ms=1000
controller.quorum.fetch.timeout.ms=2000
replica.lag.time.max.ms=5000
leader.imbalance.check.interval.seconds=5
replica.socket.timeout.ms=5000
num.network.threads=2
num.io.threads=2
num.replica.fetchers=1
background.threads=2
log.cleaner.enable=false
PROPS
    echo "$props"
}

tool() { kafka_tool kafka-cluster "$@"; } # MAIN_CLASS args...: a Kafka command-line tool

# start_node N: starts node N on its existing (formatted) data.
start_node() {
    local n=$1 props tmp_dir="$RUN_DIR/kafka-cluster-$1-tmp"
    props=$(write_node_props "$n")
    kafka_log4j_conf INFO >"$RUN_DIR/kafka-cluster-log4j2.properties"
    mkdir -p "$tmp_dir"
    # Stopping the cluster stops its last node without a quorum: its controlled shutdown would
    # wait for ever (the data is fresh at each up.sh start anyway).
    echo KILL >"$RUN_DIR/kafka-cluster-$n.stopsignal"
    # Small heap, serial-ish GC with short pauses, few JIT threads: three of them share 2 cores.
    start_bg "kafka-cluster-$n" "$KAFKA_JAVA" -Xms"$HEAP" -Xmx"$HEAP" -XX:+UseG1GC \
        -XX:MaxGCPauseMillis=20 -XX:CICompilerCount=2 -XX:ParallelGCThreads=1 \
        -XX:ConcGCThreads=1 -Djava.awt.headless=true -Djava.io.tmpdir="$tmp_dir" \
        -Dlog4j2.configurationFile="$RUN_DIR/kafka-cluster-log4j2.properties" \
        -cp "$KAFKA_LIBS/*" kafka.Kafka "$props"
}

# kill_node N: SIGKILL node N's process group (a crash: no clean shutdown), wait until it is
# gone.
kill_node() {
    local n=$1 pid i
    pid=$(service_pid "kafka-cluster-$n") || { log "kafka-cluster-$n is not running"; return 0; }
    kill -KILL -- "-$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 0.05
    done
    rm -f "$RUN_DIR/kafka-cluster-$n.pid"
}
