#!/usr/bin/env bash
# Apache Kafka 4.x, KRaft combined mode (broker+controller), single node, on
# 127.0.0.1:${ONCEFLOW_KAFKA_PORT:-19092}, controller ${ONCEFLOW_KAFKA_CONTROLLER_PORT:-19093}.
# Jars come from Maven Central through pom.xml beside this script, cached in
# $CACHE_DIR/kafka/libs. Replication factors are 1 so transactions work.
# A second listener, FAULT, on 127.0.0.1:${ONCEFLOW_KAFKA_FAULT_PORT:-19094} advertises
# 127.0.0.1:${ONCEFLOW_KAFKA_FAULT_PROXY_PORT:-19095}, where a test's fault proxy
# (tests/src/fault_proxy.rs) listens and relays to it: a client bootstrapped at the proxy stays
# behind it for every broker connection (ONCEFLOW_KAFKA_FAULT_URL, FAULT_UPSTREAM).
# Secured listeners (#23), with a throwaway CA from lib.sh's test_certs and a user `onceflow`
# whose password is made at each start (PLAIN, and SCRAM-SHA-256/512 credentials written at
# format time, KIP-900):
#   SASL_SSL       127.0.0.1:${ONCEFLOW_KAFKA_SASL_SSL_PORT:-19096}  PLAIN SCRAM-SHA-256 SCRAM-SHA-512
#                  OAUTHBEARER (unsecured JWS validator: tokens with alg "none", KIP-255)
#   SSL (mTLS)     127.0.0.1:${ONCEFLOW_KAFKA_SSL_PORT:-19097}       ssl.client.auth=required
#   SASL_PLAINTEXT 127.0.0.1:${ONCEFLOW_KAFKA_SASL_PLAINTEXT_PORT:-19098}  PLAIN SCRAM-SHA-256
# (ONCEFLOW_KAFKA_SASL_SSL_URL, _SSL_URL, _SASL_PLAINTEXT_URL, _CA, _OTHER_CA, _CLIENT_CERT,
# _CLIENT_KEY, _SASL_USERNAME, _SASL_PASSWORD). The plain listener stays as it was.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SERVICE=kafka
PORT=${ONCEFLOW_KAFKA_PORT:-19092}
CONTROLLER_PORT=${ONCEFLOW_KAFKA_CONTROLLER_PORT:-19093}
FAULT_PORT=${ONCEFLOW_KAFKA_FAULT_PORT:-19094}
FAULT_PROXY_PORT=${ONCEFLOW_KAFKA_FAULT_PROXY_PORT:-19095}
SASL_SSL_PORT=${ONCEFLOW_KAFKA_SASL_SSL_PORT:-19096}
SSL_PORT=${ONCEFLOW_KAFKA_SSL_PORT:-19097}
SASL_PLAINTEXT_PORT=${ONCEFLOW_KAFKA_SASL_PLAINTEXT_PORT:-19098}
SASL_USER=onceflow
BOOTSTRAP="127.0.0.1:$PORT"
URL="kafka://$BOOTSTRAP"
HEAP=${ONCEFLOW_KAFKA_HEAP:-512m}

api_versions() { kafka_api_versions "$PORT"; }

already_up kafka api_versions && exit 0

version=$(kafka_libs)

port_in_use "$PORT" && die "port $PORT is taken by a process we did not start"
port_in_use "$CONTROLLER_PORT" && die "port $CONTROLLER_PORT is taken by a process we did not start"
port_in_use "$FAULT_PORT" && die "port $FAULT_PORT is taken by a process we did not start"
for p in "$SASL_SSL_PORT" "$SSL_PORT" "$SASL_PLAINTEXT_PORT"; do
    port_in_use "$p" && die "port $p is taken by a process we did not start"
done
certs=$(test_certs) || die "no test certificates"
store_pass=$(<"$certs/keystore.pass")
sasl_password=$(head -c 18 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')

data=$(fresh_data_dir kafka)
tmp_dir="$RUN_DIR/kafka-tmp" # JVM temp files (native libs), kept out of log.dirs
rm -rf "$tmp_dir"
mkdir -p "$tmp_dir"
props="$RUN_DIR/kafka.properties"
: >"$props" && chmod 600 "$props" # holds the test SASL password
cat >"$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT,FAULT://127.0.0.1:$FAULT_PORT,SASL_SSL://127.0.0.1:$SASL_SSL_PORT,MTLS://127.0.0.1:$SSL_PORT,SASL_PLAINTEXT://127.0.0.1:$SASL_PLAINTEXT_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT,FAULT://127.0.0.1:$FAULT_PROXY_PORT,SASL_SSL://127.0.0.1:$SASL_SSL_PORT,MTLS://127.0.0.1:$SSL_PORT,SASL_PLAINTEXT://127.0.0.1:$SASL_PLAINTEXT_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,FAULT:PLAINTEXT,SASL_SSL:SASL_SSL,MTLS:SSL,SASL_PLAINTEXT:SASL_PLAINTEXT
ssl.keystore.type=PKCS12
ssl.keystore.location=$certs/server.p12
ssl.keystore.password=$store_pass
ssl.key.password=$store_pass
ssl.truststore.type=PKCS12
ssl.truststore.location=$certs/truststore.p12
ssl.truststore.password=$store_pass
listener.name.mtls.ssl.client.auth=required
listener.name.sasl_ssl.sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512,OAUTHBEARER
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$SASL_USER="$sasl_password";
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;
listener.name.sasl_ssl.oauthbearer.sasl.server.callback.handler.class=org.apache.kafka.common.security.oauthbearer.internals.unsecured.OAuthBearerUnsecuredValidatorCallbackHandler
listener.name.sasl_plaintext.sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$SASL_USER="$sasl_password";
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
log.dirs=$data
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=true
delete.topic.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
share.coordinator.state.topic.num.partitions=1
group.initial.rebalance.delay.ms=0
PROPS

kafka_log4j_conf INFO >"$RUN_DIR/kafka-log4j2.properties"
tool() { kafka_tool kafka "$@"; } # MAIN_CLASS args...: a Kafka command-line tool

# Cluster id: 16 random bytes, URL-safe base64 without padding (what
# `kafka-storage.sh random-uuid` prints); Kafka avoids ids starting with '-'.
cluster_id=-
while [[ $cluster_id == -* ]]; do
    cluster_id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')
done
log "formatting Kafka $version storage in $data"
tool kafka.tools.StorageTool format --cluster-id "$cluster_id" --config "$props" \
    --add-scram "SCRAM-SHA-256=[name=$SASL_USER,password=$sasl_password]" \
    --add-scram "SCRAM-SHA-512=[name=$SASL_USER,password=$sasl_password]" \
    >"$RUN_DIR/kafka-format.log" 2>&1 ||
    { cat "$RUN_DIR/kafka-format.log" >&2; die "kafka storage format failed"; }

log "starting Kafka $version on $BOOTSTRAP (controller 127.0.0.1:$CONTROLLER_PORT)"
start_bg kafka "$KAFKA_JAVA" -Xms"$HEAP" -Xmx"$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -Djava.awt.headless=true -Djava.io.tmpdir="$tmp_dir" \
    -Dlog4j2.configurationFile="$RUN_DIR/kafka-log4j2.properties" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$props"
wait_for_port 127.0.0.1 "$PORT" 90 || die "Kafka did not open $BOOTSTRAP"
wait_until 60 api_versions || die "Kafka does not answer ApiVersions on $BOOTSTRAP"

# Ready means the controller works and the broker is unfenced: create and delete
# a topic (retried while the broker registers).
probe_topic=__onceflow_probe
wait_until 60 tool org.apache.kafka.tools.TopicCommand --bootstrap-server "$BOOTSTRAP" \
    --create --if-not-exists --topic "$probe_topic" --partitions 1 --replication-factor 1 ||
    die "Kafka cannot create a topic"
tool org.apache.kafka.tools.TopicCommand --bootstrap-server "$BOOTSTRAP" \
    --delete --topic "$probe_topic" >&2 || die "Kafka cannot delete a topic"
emit_env kafka "ONCEFLOW_KAFKA_URL=$URL" \
    "ONCEFLOW_KAFKA_FAULT_URL=kafka://127.0.0.1:$FAULT_PROXY_PORT" \
    "ONCEFLOW_KAFKA_FAULT_UPSTREAM=127.0.0.1:$FAULT_PORT" \
    "ONCEFLOW_KAFKA_SASL_SSL_URL=kafka://127.0.0.1:$SASL_SSL_PORT" \
    "ONCEFLOW_KAFKA_SSL_URL=kafka://127.0.0.1:$SSL_PORT" \
    "ONCEFLOW_KAFKA_SASL_PLAINTEXT_URL=kafka://127.0.0.1:$SASL_PLAINTEXT_PORT" \
    "ONCEFLOW_KAFKA_CA=$certs/ca.pem" "ONCEFLOW_KAFKA_OTHER_CA=$certs/other-ca.pem" \
    "ONCEFLOW_KAFKA_CLIENT_CERT=$certs/client.pem" "ONCEFLOW_KAFKA_CLIENT_KEY=$certs/client.key" \
    "ONCEFLOW_KAFKA_SASL_USERNAME=$SASL_USER" "ONCEFLOW_KAFKA_SASL_PASSWORD=$sasl_password"
