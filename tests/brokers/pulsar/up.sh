#!/usr/bin/env bash
# Start Apache Pulsar standalone (broker + one bookie + RocksDB metadata, one JVM)
# on loopback for the tests. Prints only KEY=VALUE lines on stdout:
#   ONCEFLOW_PULSAR_URL=pulsar://127.0.0.1:16650
#   ONCEFLOW_PULSAR_ADMIN_URL=http://127.0.0.1:18080
#   ONCEFLOW_PULSAR_FAULT_URL=pulsar://127.0.0.1:16653
#   ONCEFLOW_PULSAR_FAULT_UPSTREAM=127.0.0.1:16652
#   ONCEFLOW_PULSAR_TLS_URL=pulsar+ssl://127.0.0.1:16651
#   ONCEFLOW_PULSAR_TLS_ADMIN_URL=https://127.0.0.1:18443
#   ONCEFLOW_PULSAR_TLS_CA, ONCEFLOW_PULSAR_OTHER_CA (PEM files), ONCEFLOW_PULSAR_TOKEN_FILE,
#   ONCEFLOW_PULSAR_TOKEN_FILE_B, ONCEFLOW_PULSAR_EXPIRED_TOKEN_FILE,
#   ONCEFLOW_PULSAR_OTHER_KEY_TOKEN_FILE, ONCEFLOW_PULSAR_TOKEN_SECRET_KEY (files)
#   ONCEFLOW_PULSAR_CLIENT_CERT, ONCEFLOW_PULSAR_CLIENT_KEY (PEM: lib.sh's client certificate,
#   CN=onceflow-client, signed by the test CA), ONCEFLOW_PULSAR_ROGUE_CLIENT_CERT,
#   ONCEFLOW_PULSAR_ROGUE_CLIENT_KEY (PEM: a client certificate signed by the other CA, which
#   the broker must refuse)
# Security: TLS listeners (broker ONCEFLOW_PULSAR_TLS_PORT 16651, web ONCEFLOW_PULSAR_ADMIN_TLS_PORT
# 18443) with the throwaway certificates of lib.sh's test_certs, and token authentication
# (AuthenticationProviderToken, HS256 secret key and tokens made at start with Pulsar's own
# token tool, TokensCliUtils) plus AuthenticationProviderTls (mTLS: the TLS listeners ask for a
# client certificate, verify one against the test CA and refuse one it did not sign; the role is
# the certificate's CN), on every listener. A client that
# presents no credential is the anonymous role (anonymousUserRole, authorization off), so the
# plain listeners work without credentials as before; a client presenting a wrong, expired or
# foreign-signed token is refused.
# A second listener, `fault`, binds 127.0.0.1:${ONCEFLOW_PULSAR_FAULT_PORT:-16652} and
# advertises 127.0.0.1:${ONCEFLOW_PULSAR_FAULT_PROXY_PORT:-16653}, where a test's fault proxy
# (tests/src/fault_proxy.rs) listens and relays to it. The broker answers a lookup that names no
# listener with the listener of the address the client connected to (PIP-95), so a client whose
# service URL is the proxy is sent back to the proxy for every topic and stays behind it.
# Jars come from Maven Central (pom.xml here), cached in $CACHE_DIR/pulsar/libs.
# Ports: ONCEFLOW_PULSAR_PORT (16650), ONCEFLOW_PULSAR_ADMIN_PORT (18080),
# ONCEFLOW_PULSAR_BOOKIE_PORT (13181). Extra JVM flags: ONCEFLOW_PULSAR_JAVA_OPTS.
# Java: ONCEFLOW_PULSAR_JAVA, else $JAVA_HOME/bin/java, else java on PATH (>= 17).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$HERE/../lib.sh"

PORT=${ONCEFLOW_PULSAR_PORT:-16650}
ADMIN_PORT=${ONCEFLOW_PULSAR_ADMIN_PORT:-18080}
BOOKIE_PORT=${ONCEFLOW_PULSAR_BOOKIE_PORT:-13181}
FAULT_PORT=${ONCEFLOW_PULSAR_FAULT_PORT:-16652}
FAULT_PROXY_PORT=${ONCEFLOW_PULSAR_FAULT_PROXY_PORT:-16653}
START_TIMEOUT_S=${ONCEFLOW_PULSAR_START_TIMEOUT_S:-180}
ADMIN_URL=http://127.0.0.1:$ADMIN_PORT
PROBE_TOPIC=$ADMIN_URL/admin/v2/persistent/public/default/onceflow-probe
TLS_PORT=${ONCEFLOW_PULSAR_TLS_PORT:-16651}
ADMIN_TLS_PORT=${ONCEFLOW_PULSAR_ADMIN_TLS_PORT:-18443}
LIBS=$CACHE_DIR/pulsar/libs

# The broker answers admin calls and owns public/default.
# A broker started before the TLS listener, tokens and client certificates existed is restarted
# (its env lacks them).
answers() {
    grep -q '^ONCEFLOW_PULSAR_ROGUE_CLIENT_KEY=' "$RUN_DIR/pulsar.env" &&
        curl -sf -m 5 -o /dev/null "$ADMIN_URL/admin/v2/brokers/ready" &&
        curl -sf -m 5 -o /dev/null "$ADMIN_URL/admin/v2/persistent/public/default"
}

# A topic can really be created (metadata store, bookie and namespace bundle
# ownership all work) and its stats read.
probe_topic() {
    local code
    code=$(curl -s -m 10 -o /dev/null -w '%{http_code}' -X PUT "$PROBE_TOPIC") || return 1
    [[ $code == 204 || $code == 409 ]] || return 1
    curl -sf -m 10 -o /dev/null "$PROBE_TOPIC/stats"
}

if already_up pulsar answers; then
    exit 0
fi

# --- java ---------------------------------------------------------------------
# ONCEFLOW_PULSAR_JAVA if set, else the newest Java >= 17 found (JAVA_HOME, PATH,
# /usr/lib/jvm): on a newer JDK the class-data archive below is kept up to date
# by the JVM itself, which about halves the CPU the broker needs to start.
java_major() {
    "$1" -XshowSettings:properties -version 2>&1 |
        awk -F' = ' '/java.specification.version/ {print $2; exit}'
}
JAVA=
JAVA_MAJOR=0
if [[ -n ${ONCEFLOW_PULSAR_JAVA:-} ]]; then
    JAVA=$ONCEFLOW_PULSAR_JAVA
    JAVA_MAJOR=$(java_major "$JAVA") || die "ONCEFLOW_PULSAR_JAVA=$JAVA does not run"
else
    for candidate in "${JAVA_HOME:+$JAVA_HOME/bin/java}" "$(command -v java || true)" /usr/lib/jvm/*/bin/java; do
        [[ -n $candidate && -x $candidate ]] || continue
        major=$(java_major "$candidate") || continue
        if [[ $major =~ ^[0-9]+$ ]] && ((major > JAVA_MAJOR)); then
            JAVA=$candidate
            JAVA_MAJOR=$major
        fi
    done
fi
if ! [[ $JAVA_MAJOR =~ ^[0-9]+$ ]] || ((JAVA_MAJOR < 17)); then
    die "pulsar needs Java 17 or newer (found: ${JAVA:-none}; set ONCEFLOW_PULSAR_JAVA)"
fi

# --- jars (cached; refetched when pom.xml changes) ------------------------------
POM_SUM=$(sha256sum "$HERE/pom.xml" | cut -d' ' -f1)
if [[ $(cat "$LIBS/.pom.sha256" 2>/dev/null) != "$POM_SUM" ]]; then
    mkdir -p "$CACHE_DIR/pulsar"
    exec {dl_lock}>"$CACHE_DIR/pulsar/.lock"
    flock "$dl_lock"
    if [[ $(cat "$LIBS/.pom.sha256" 2>/dev/null) != "$POM_SUM" ]]; then
        command -v mvn >/dev/null || die "mvn not found: needed once to fetch the Pulsar jars"
        log "fetching Pulsar jars from Maven Central into $LIBS (once)"
        rm -rf "$LIBS.tmp"
        mvn -q -B -Dstyle.color=never -f "$HERE/pom.xml" dependency:copy-dependencies \
            -DincludeScope=runtime -DoutputDirectory="$LIBS.tmp" >&2 ||
            die "mvn could not fetch the Pulsar jars"
        echo "$POM_SUM" >"$LIBS.tmp/.pom.sha256"
        rm -rf "$LIBS"
        mv "$LIBS.tmp" "$LIBS"
    fi
    exec {dl_lock}>&-
fi

# --- start ----------------------------------------------------------------------
for p in "$PORT" "$ADMIN_PORT" "$BOOKIE_PORT" "$FAULT_PORT" "$TLS_PORT" "$ADMIN_TLS_PORT"; do
    ! port_in_use "$p" || die "port $p on 127.0.0.1 is already in use (not by our pulsar)"
done

DATA=$(fresh_data_dir pulsar)
CERTS=$(test_certs) || die "cannot make the test certificates"
# The token tool (TokensCliUtils, `bin/pulsar tokens`), one JVM per call.
tokens() {
    "$JAVA" -Xshare:auto -XX:TieredStopAtLevel=1 -cp "$LIBS/*" \
        org.apache.pulsar.utils.auth.tokens.TokensCliUtils "$@"
}
AUTH=$DATA/auth
mkdir -p "$AUTH"
chmod 700 "$AUTH"
tokens create-secret-key --output "$AUTH/secret.key" >&2 ||
    die "the Pulsar token tool could not make a secret key"
# An unrelated HS256 key (32 random bytes, what create-secret-key makes), for a token the
# broker must refuse.
openssl rand -out "$AUTH/other.key" 32
# A client certificate from the CA that signed nothing else (its key next to it): presented on
# the TLS listener, the broker must refuse it.
(
    cd "$AUTH"
    exec >/dev/null 2>&1
    openssl req -newkey rsa:2048 -nodes -subj "/CN=onceflow-rogue-client" \
        -keyout rogue-client.key -out rogue-client.csr
    printf '%s\n' "extendedKeyUsage=clientAuth" "basicConstraints=CA:FALSE" >rogue.ext
    openssl x509 -req -in rogue-client.csr -CA "$CERTS/other-ca.pem" \
        -CAkey "$CERTS/other-ca.key" -CAserial "$AUTH/rogue.srl" -CAcreateserial -days 30 \
        -extfile rogue.ext -out rogue-client.pem
    rm -f rogue-client.csr rogue.ext rogue.srl
) || die "cannot make the rogue client certificate"
sed -e "s/^brokerServicePort=.*/brokerServicePort=$PORT/" \
    -e "s/^webServicePort=.*/webServicePort=$ADMIN_PORT/" \
    "$HERE/standalone.conf" >"$DATA/standalone.conf"
# The fault listener (PIP-61 advertised listeners, PIP-95 bind addresses): `internal` is the
# brokerServicePort above (and brokerServicePortTls), `fault` binds FAULT_PORT and advertises
# the proxy's FAULT_PROXY_PORT. TLS and token authentication: see standalone.conf.
cat >>"$DATA/standalone.conf" <<CONF
advertisedListeners=internal:pulsar://127.0.0.1:$PORT,internal:pulsar+ssl://127.0.0.1:$TLS_PORT,fault:pulsar://127.0.0.1:$FAULT_PROXY_PORT
internalListenerName=internal
bindAddresses=fault:pulsar://127.0.0.1:$FAULT_PORT
brokerServicePortTls=$TLS_PORT
webServicePortTls=$ADMIN_TLS_PORT
tlsCertificateFilePath=$CERTS/server.pem
tlsKeyFilePath=$CERTS/server.key
tlsTrustCertsFilePath=$CERTS/ca.pem
tokenSecretKey=file://$AUTH/secret.key
CONF

java_opts=(
    -Xms256m -Xmx1g -XX:MaxDirectMemorySize=384m
    -XX:+UseG1GC -XX:ParallelGCThreads=2 -XX:ConcGCThreads=1
    -XX:TieredStopAtLevel=1 -Xss512k
    # what Pulsar's own launcher passes on Java 17+
    --add-opens java.base/java.io=ALL-UNNAMED
    --add-opens java.base/java.util.zip=ALL-UNNAMED
    --add-opens java.base/sun.net=ALL-UNNAMED
    --add-opens java.management/sun.management=ALL-UNNAMED
    --add-opens jdk.management/com.sun.management.internal=ALL-UNNAMED
    --add-opens java.base/jdk.internal.misc=ALL-UNNAMED
    --add-opens java.base/java.nio=ALL-UNNAMED
    --add-opens java.base/java.lang=ALL-UNNAMED
    --add-exports java.base/jdk.internal.platform=ALL-UNNAMED
    -Dio.netty.tryReflectionSetAccessible=true
    -Djava.net.preferIPv4Stack=true
    -Dpulsar.allocator.exit_on_oom=true
    -Dlog4j.configurationFile="$HERE/log4j2.xml"
    -Dlog4j2.shutdownHookEnabled=false
    -Djava.io.tmpdir="$DATA"
)
if ((JAVA_MAJOR >= 19)); then
    # dynamic class-data archive, written by the JVM at exit, reused next start
    jsa=java$JAVA_MAJOR-${POM_SUM:0:12}.jsa
    mkdir -p "$CACHE_DIR/pulsar/cds"
    find "$CACHE_DIR/pulsar/cds" -name '*.jsa' ! -name "$jsa" -delete
    java_opts+=(-XX:+AutoCreateSharedArchive -XX:SharedArchiveFile="$CACHE_DIR/pulsar/cds/$jsa"
        -Xlog:cds=off -Xlog:cds+dynamic=off)
fi
if ((JAVA_MAJOR >= 24)); then
    # netty and rocksdb still use sun.misc.Unsafe and JNI: keep the log quiet
    java_opts+=(--enable-native-access=ALL-UNNAMED --sun-misc-unsafe-memory-access=allow)
fi
# shellcheck disable=SC2206 # word splitting of the extra flags is wanted
java_opts+=(${ONCEFLOW_PULSAR_JAVA_OPTS:-})

broker_jar=$(cd "$LIBS" && echo pulsar-broker-[0-9]*.jar)
broker_jar=${broker_jar#pulsar-broker-}
log "starting pulsar ${broker_jar%.jar} with $JAVA"
cd "$DATA"
start_bg pulsar "$JAVA" "${java_opts[@]}" -cp "$LIBS/*" org.apache.pulsar.PulsarStandaloneStarter \
    --config "$DATA/standalone.conf" \
    --metadata-dir "$DATA/metadata" \
    --bookkeeper-dir "$DATA/bookkeeper" \
    --bookkeeper-port "$BOOKIE_PORT" \
    --no-functions-worker \
    --no-stream-storage

# The tokens, made while the broker starts: two roles, one expired (1 s), one signed with the
# unrelated key.
make_tokens() {
    tokens create --secret-key "file://$AUTH/secret.key" --subject onceflow-a >"$AUTH/a.token" &&
        tokens create --secret-key "file://$AUTH/secret.key" --subject onceflow-b >"$AUTH/b.token" &&
        tokens create --secret-key "file://$AUTH/secret.key" --subject onceflow-a \
            --expiry-time 1s >"$AUTH/expired.token" &&
        tokens create --secret-key "file://$AUTH/other.key" --subject onceflow-a \
            >"$AUTH/other-key.token"
}
make_tokens 2>&1 >&2 | tail -n 5 >&2 || true
for f in a b expired other-key; do
    grep -q '^ey' "$AUTH/$f.token" 2>/dev/null || die "the Pulsar token tool did not make $f.token"
done
chmod 600 "$AUTH"/*

wait_until "$START_TIMEOUT_S" probe_topic ||
    die "pulsar exited, or did not accept a topic within ${START_TIMEOUT_S}s"
# The TLS listeners answer with the test CA (and the web one accepts a token).
curl -sf -m 10 -o /dev/null --cacert "$CERTS/ca.pem" -H "Authorization: Bearer $(<"$AUTH/a.token")" \
    "https://127.0.0.1:$ADMIN_TLS_PORT/admin/v2/brokers/ready" ||
    die "pulsar's TLS web service on $ADMIN_TLS_PORT does not answer"
wait_for_port 127.0.0.1 "$TLS_PORT" 10 || die "pulsar's TLS broker port $TLS_PORT is not open"
log "pulsar ready after ${SECONDS}s"

emit_env pulsar \
    "ONCEFLOW_PULSAR_URL=pulsar://127.0.0.1:$PORT" \
    "ONCEFLOW_PULSAR_ADMIN_URL=$ADMIN_URL" \
    "ONCEFLOW_PULSAR_FAULT_URL=pulsar://127.0.0.1:$FAULT_PROXY_PORT" \
    "ONCEFLOW_PULSAR_FAULT_UPSTREAM=127.0.0.1:$FAULT_PORT" \
    "ONCEFLOW_PULSAR_TLS_URL=pulsar+ssl://127.0.0.1:$TLS_PORT" \
    "ONCEFLOW_PULSAR_TLS_ADMIN_URL=https://127.0.0.1:$ADMIN_TLS_PORT" \
    "ONCEFLOW_PULSAR_TLS_CA=$CERTS/ca.pem" \
    "ONCEFLOW_PULSAR_OTHER_CA=$CERTS/other-ca.pem" \
    "ONCEFLOW_PULSAR_TOKEN_FILE=$AUTH/a.token" \
    "ONCEFLOW_PULSAR_TOKEN_FILE_B=$AUTH/b.token" \
    "ONCEFLOW_PULSAR_EXPIRED_TOKEN_FILE=$AUTH/expired.token" \
    "ONCEFLOW_PULSAR_OTHER_KEY_TOKEN_FILE=$AUTH/other-key.token" \
    "ONCEFLOW_PULSAR_TOKEN_SECRET_KEY=$AUTH/secret.key" \
    "ONCEFLOW_PULSAR_CLIENT_CERT=$CERTS/client.pem" \
    "ONCEFLOW_PULSAR_CLIENT_KEY=$CERTS/client.key" \
    "ONCEFLOW_PULSAR_ROGUE_CLIENT_CERT=$AUTH/rogue-client.pem" \
    "ONCEFLOW_PULSAR_ROGUE_CLIENT_KEY=$AUTH/rogue-client.key"
