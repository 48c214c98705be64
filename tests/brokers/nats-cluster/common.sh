# shellcheck shell=bash
# Shared by nats-cluster/up.sh and nats-cluster/node.sh: a 3-node nats-server JetStream
# cluster on loopback. Node N (1..3) is the service `nats-cluster-N` of lib.sh: pid in
# $RUN_DIR/nats-cluster-N.pid, log in $RUN_DIR/nats-cluster-N.log, store in
# $RUN_DIR/nats-cluster-N-data (kept across a node's restart, fresh at each up.sh start).
# Ports (each base overridable): client ${ONCEFLOW_NATS_CLUSTER_PORT:-14240}+N,
# cluster routes ${ONCEFLOW_NATS_CLUSTER_ROUTE_PORT:-16240}+N,
# monitor ${ONCEFLOW_NATS_CLUSTER_MONITOR_PORT:-18240}+N.
# JetStream is capped per node (ONCEFLOW_NATS_CLUSTER_MAX_MEM, _MAX_FILE) so three fit a
# small machine.
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
NATS_VERSION=${ONCEFLOW_NATS_VERSION:-2.14.6}
NATS_BIN="$CACHE_DIR/venv-nats/bin/nats-server"
CLUSTER_PORT_BASE=${ONCEFLOW_NATS_CLUSTER_PORT:-14240}
CLUSTER_ROUTE_BASE=${ONCEFLOW_NATS_CLUSTER_ROUTE_PORT:-16240}
CLUSTER_MONITOR_BASE=${ONCEFLOW_NATS_CLUSTER_MONITOR_PORT:-18240}
CLUSTER_MAX_MEM=${ONCEFLOW_NATS_CLUSTER_MAX_MEM:-256MB}
CLUSTER_MAX_FILE=${ONCEFLOW_NATS_CLUSTER_MAX_FILE:-2GB}
NODES=(1 2 3)

node_port() { echo $((CLUSTER_PORT_BASE + $1)); }
node_route_port() { echo $((CLUSTER_ROUTE_BASE + $1)); }
node_monitor_port() { echo $((CLUSTER_MONITOR_BASE + $1)); }
# Server names: the stream info's cluster.leader names one of these.
node_name() { echo "onceflow-nc$1"; }

cluster_url() {
    local n urls=()
    for n in "${NODES[@]}"; do urls+=("127.0.0.1:$(node_port "$n")"); done
    local IFS=,
    echo "nats://${urls[*]}"
}

# node_healthy N: JetStream enabled and current on node N.
node_healthy() {
    [[ $(curl -fsS --max-time 2 "http://127.0.0.1:$(node_monitor_port "$1")/healthz") == *'"ok"'* ]]
}

# write_node_conf N: the node's config file (path printed).
write_node_conf() {
    local n=$1 conf="$RUN_DIR/nats-cluster-$1.conf" m routes=()
    for m in "${NODES[@]}"; do routes+=("nats-route://127.0.0.1:$(node_route_port "$m")"); done
    cat >"$conf" <<CONF
server_name: $(node_name "$n")
listen: 127.0.0.1:$(node_port "$n")
http: 127.0.0.1:$(node_monitor_port "$n")
jetstream {
    store_dir: "$RUN_DIR/nats-cluster-$n-data"
    max_mem: $CLUSTER_MAX_MEM
    max_file: $CLUSTER_MAX_FILE
}
cluster {
    name: onceflow-cluster
    listen: 127.0.0.1:$(node_route_port "$n")
    routes: [
$(printf '        %s\n' "${routes[@]}")
    ]
}
CONF
    echo "$conf"
}

# start_node N: starts node N on its existing store (a restart after a kill).
start_node() {
    local n=$1 conf
    conf=$(write_node_conf "$n")
    mkdir -p "$RUN_DIR/nats-cluster-$n-data"
    start_bg "nats-cluster-$n" "$NATS_BIN" -c "$conf"
}

# kill_node N: SIGKILL node N's process group (a crash: no clean shutdown) and wait until
# it is gone.
kill_node() {
    local n=$1 pid i
    pid=$(service_pid "nats-cluster-$n") || { log "nats-cluster-$n is not running"; return 0; }
    kill -KILL -- "-$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 0.05
    done
    rm -f "$RUN_DIR/nats-cluster-$n.pid"
}

# js_request PORT SUBJECT JSON: a JetStream API request over the NATS protocol with bash's
# /dev/tcp; prints the reply's payload (fails when none comes within 5 s).
js_request() {
    local port=$1 subject=$2 json=$3 line reply=
    exec 3<>"/dev/tcp/127.0.0.1/$port" || return 1
    printf 'CONNECT {"verbose":false,"pedantic":false}\r\nSUB _INBOX.onceflow_probe 1\r\nPUB %s _INBOX.onceflow_probe %d\r\n%s\r\n' \
        "$subject" "${#json}" "$json" >&3
    # (awk may wait to fill its input buffer from a socket: bash's read does not.)
    while IFS= read -r -t 5 line <&3; do
        if [[ $line == "MSG "* ]]; then
            IFS= read -r -t 5 reply <&3 || reply=
            break
        fi
    done
    exec 3<&-
    [[ -n $reply ]] || return 1
    printf '%s\n' "${reply%$'\r'}"
}
