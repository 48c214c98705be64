# shellcheck shell=bash
# Shared by kafka-cluster/up.sh and kafka-cluster/node.sh: a 3-node Apache Kafka KRaft cluster
# on loopback, each node broker and controller (combined). Node N (1..3) is the service
# `kafka-cluster-N` of lib.sh: pid in $RUN_DIR/kafka-cluster-N.pid, log in
# $RUN_DIR/kafka-cluster-N.log, data in $RUN_DIR/kafka-cluster-N-data (kept across a node's
# restart, fresh at each up.sh start). Same jars as tests/brokers/kafka (its pom.xml, cached in
# $CACHE_DIR/kafka/libs by tests/brokers/kafka/up.sh or by ensure_kafka_libs below).
# Ports: broker ${ONCEFLOW_KAFKA_CLUSTER_PORT:-19110}+N, controller
# ${ONCEFLOW_KAFKA_CLUSTER_CONTROLLER_PORT:-19120}+N. Heap per node ${ONCEFLOW_KAFKA_CLUSTER_HEAP:-384m}.
# A second client listener, FAULT, binds ${ONCEFLOW_KAFKA_CLUSTER_FAULT_PORT:-19130}+N and advertises
# ${ONCEFLOW_KAFKA_CLUSTER_FAULT_PROXY_PORT:-19140}+N, where a network-fault test runs one fault proxy
# per node (tests/src/fault_proxy.rs) relaying to the FAULT port: a client bootstrapped on the
# proxy ports stays behind the proxies for every broker. Brokers talk to each other on
# PLAINTEXT, never through the proxies.
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
KAFKA_POM="$BROKERS_DIR/kafka/pom.xml"
LIBS="$CACHE_DIR/kafka/libs"
JAVA=${ONCEFLOW_KAFKA_JAVA:-${JAVA_HOME:+$JAVA_HOME/bin/}java}
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

bootstrap() { joined node_port; }

# api_versions PORT: a real Kafka request over bash's /dev/tcp (ApiVersions v0, correlation
# id 42); the broker must answer with that correlation id.
api_versions() {
    local reply
    exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
    printf '\x00\x00\x00\x10\x00\x12\x00\x00\x00\x00\x00\x2a\x00\x06probe1' >&3
    reply=$(timeout 3 head -c 8 <&3 | od -An -tx1 | tr -d ' \n')
    exec 3<&-
    [[ ${reply:8:8} == 0000002a ]]
}

# ensure_kafka_libs: the Kafka jars of tests/brokers/kafka/pom.xml in $LIBS (resolved once per
# pom.xml content, exactly as tests/brokers/kafka/up.sh does).
ensure_kafka_libs() {
    local pom_sum tmp
    pom_sum=$(sha256sum "$KAFKA_POM" | cut -d' ' -f1)
    if [[ ! -f $LIBS/.pom.sha256 || $(<"$LIBS/.pom.sha256") != "$pom_sum" ]]; then
        command -v mvn >/dev/null || die "mvn not found (apt-get install maven)"
        log "resolving Kafka jars with Maven into $LIBS"
        tmp="$LIBS.tmp.$$"
        rm -rf "$tmp"
        mkdir -p "$CACHE_DIR/kafka"
        if ! mvn -B -f "$KAFKA_POM" dependency:copy-dependencies -DoutputDirectory="$tmp" \
            >"$CACHE_DIR/kafka/mvn.log" 2>&1; then
            tail -n 40 "$CACHE_DIR/kafka/mvn.log" >&2
            rm -rf "$tmp"
            die "mvn dependency:copy-dependencies failed (log: $CACHE_DIR/kafka/mvn.log)"
        fi
        echo "$pom_sum" >"$tmp/.pom.sha256"
        rm -rf "$LIBS"
        mv "$tmp" "$LIBS"
    fi
}

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

log4j_conf() { # LEVEL: log4j2 config printing to the console
    cat <<L4J
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = $1
rootLogger.appenderRef.out.ref = OUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
L4J
}

tool() { # MAIN_CLASS args...: run a Kafka command-line tool
    log4j_conf WARN >"$RUN_DIR/kafka-cluster-tools-log4j2.properties"
    timeout 90 "$JAVA" -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
        -Dlog4j2.configurationFile="$RUN_DIR/kafka-cluster-tools-log4j2.properties" \
        -cp "$LIBS/*" "$@"
}

# start_node N: starts node N on its existing (formatted) data.
start_node() {
    local n=$1 props tmp_dir="$RUN_DIR/kafka-cluster-$1-tmp"
    props=$(write_node_props "$n")
    log4j_conf INFO >"$RUN_DIR/kafka-cluster-log4j2.properties"
    mkdir -p "$tmp_dir"
    # Stopping the cluster stops its last node without a quorum: its controlled shutdown would
    # wait for ever (the data is fresh at each up.sh start anyway).
    echo KILL >"$RUN_DIR/kafka-cluster-$n.stopsignal"
    # Small heap, serial-ish GC with short pauses, few JIT threads: three of them share 2 cores.
    start_bg "kafka-cluster-$n" "$JAVA" -Xms"$HEAP" -Xmx"$HEAP" -XX:+UseG1GC \
        -XX:MaxGCPauseMillis=20 -XX:CICompilerCount=2 -XX:ParallelGCThreads=1 \
        -XX:ConcGCThreads=1 -Djava.awt.headless=true -Djava.io.tmpdir="$tmp_dir" \
        -Dlog4j2.configurationFile="$RUN_DIR/kafka-cluster-log4j2.properties" \
        -cp "$LIBS/*" kafka.Kafka "$props"
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
