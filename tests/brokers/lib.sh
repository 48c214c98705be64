# shellcheck shell=bash
# Shared helpers for the broker harness scripts under tests/brokers/.
# Sourced by tests/brokers/{up,down,env}.sh and tests/brokers/NAME/up.sh.
#
# Contract (every NAME/up.sh follows it):
#   - stdout carries only KEY=VALUE lines (ONCEFLOW_..._URL=...), via emit_env;
#     progress goes to stderr (log).
#   - a service already running (pid alive AND answering) just re-prints its env.
#   - processes are started with start_bg: own session, PID == process group id,
#     pid in $RUN_DIR/NAME.pid, output in $RUN_DIR/NAME.log.
#   - data lives in $RUN_DIR/NAME-data (fresh each start), downloads in $CACHE_DIR.
#   - everything binds to 127.0.0.1 only.
#
# Default ports (each overridable by the env variable named):
#   kafka     19092  ONCEFLOW_KAFKA_PORT,  controller 19093 ONCEFLOW_KAFKA_CONTROLLER_PORT,
#             fault listener 19094 ONCEFLOW_KAFKA_FAULT_PORT (advertised as the fault proxy's
#             19095, ONCEFLOW_KAFKA_FAULT_PROXY_PORT)
#   nats      14222  ONCEFLOW_NATS_PORT,   monitor 18222    ONCEFLOW_NATS_MONITOR_PORT
#   redis     16379  ONCEFLOW_REDIS_PORT
#   postgres  15432  ONCEFLOW_POSTGRES_PORT
#   pulsar    16650  ONCEFLOW_PULSAR_PORT, admin 18080      ONCEFLOW_PULSAR_ADMIN_PORT
#   kinesis   14567  ONCEFLOW_KINESIS_PORT

RUN_DIR=${ONCEFLOW_RUN_DIR:-/tmp/onceflow-brokers}
CACHE_DIR=${ONCEFLOW_CACHE_DIR:-${HOME:-/tmp}/.cache/onceflow}
# shellcheck disable=SC2034  # used by the scripts that source this file
BROKERS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$RUN_DIR" "$CACHE_DIR"

# Name of the service whose log `die` shows; set by start_bg (or by the script).
LAST_STARTED=${LAST_STARTED:-}
_LIB_T0=$(date +%s)

log() {
    printf '[brokers] %s\n' "$*" >&2
}

# Seconds since the epoch at which process PID started; fails if PID is gone
# or a zombie (killed but not yet reaped).
_proc_start_epoch() {
    local pid=$1 stat btime ticks
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }                      # drop "pid (comm) "; field 3 is now $1
    # shellcheck disable=SC2086
    set -- $stat
    [[ $1 != [ZX] ]] || return 1           # field 3: state
    ticks=${20}                            # field 22: starttime, in clock ticks after boot
    btime=$(awk '/^btime/ {print $2}' /proc/stat)
    echo $((btime + ticks / $(getconf CLK_TCK)))
}

# Prints the pid recorded for NAME if that process is alive and is the one we
# started (a process group leader that did not start after the pid file was
# written, so a recycled pid is not mistaken for ours).
service_pid() {
    local name=$1 pidfile="$RUN_DIR/$1.pid" pid pgid start mtime
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    pgid=$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ') || return 1
    [[ $pgid == "$pid" ]] || return 1
    start=$(_proc_start_epoch "$pid") || return 1
    mtime=$(stat -c %Y "$pidfile")
    ((start <= mtime + 2)) || return 1
    echo "$pid"
}

# is_running NAME: pid file exists and that process is alive.
is_running() {
    service_pid "$1" >/dev/null
}

# start_bg NAME cmd...: start cmd in a new session (PID == PGID), output to
# $RUN_DIR/NAME.log, pid to $RUN_DIR/NAME.pid.
start_bg() {
    local name=$1 pidfile="$RUN_DIR/$1.pid" i
    shift
    rm -f "$pidfile"
    LAST_STARTED=$name
    # The new session leader closes every inherited fd above 2 (a caller's pipe
    # or lock must not live on in the daemon), writes its own pid and then execs
    # cmd, so the pid is right whether or not setsid had to fork.
    # shellcheck disable=SC2016  # expanded by the inner bash
    ONCEFLOW_BROKER=$name setsid bash -c '
        for fd in /proc/$$/fd/*; do
            fd=${fd##*/}
            if ((fd > 2)); then eval "exec $fd>&-"; fi
        done
        echo $$ >"$0.tmp" && mv "$0.tmp" "$0" && exec "$@"' \
        "$pidfile" "$@" </dev/null >"$RUN_DIR/$name.log" 2>&1 &
    for ((i = 0; i < 100; i++)); do
        [[ -s $pidfile ]] && return 0
        sleep 0.05
    done
    die "$name: no pid file after start"
}

# stop_service NAME: SIGTERM the process group recorded in $RUN_DIR/NAME.pid,
# wait up to ${STOP_TIMEOUT_S:-20} s, then SIGKILL. Removes the pid and env files.
# A service whose clean stop needs another signal (postgres: SIGTERM is its
# "smart" shutdown, which waits for every client to leave) names it in
# $RUN_DIR/NAME.stopsignal.
stop_service() {
    local name=$1 pid i timeout=${STOP_TIMEOUT_S:-20} sig=TERM
    if [[ -s $RUN_DIR/$name.stopsignal ]]; then
        sig=$(<"$RUN_DIR/$name.stopsignal")
        [[ $sig =~ ^[A-Z0-9]+$ ]] || sig=TERM
    fi
    if pid=$(service_pid "$name"); then
        log "stopping $name (pgid $pid, SIG$sig)"
        kill -"$sig" -- "-$pid" 2>/dev/null || true
        kill -CONT -- "-$pid" 2>/dev/null || true # a stopped process acts on it too
        for ((i = 0; i < timeout * 10; i++)); do
            kill -0 -- "-$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 -- "-$pid" 2>/dev/null; then
            log "$name did not stop within ${timeout}s, sending SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                kill -0 -- "-$pid" 2>/dev/null || break
                sleep 0.1
            done
        fi
    elif [[ -s $RUN_DIR/$name.pid ]]; then
        pid=$(<"$RUN_DIR/$name.pid")
        # The leader is gone but members of its group may be left. While the
        # group exists Linux does not hand its id out as a new pid, so it is ours.
        if [[ $pid =~ ^[0-9]+$ ]] && ! kill -0 "$pid" 2>/dev/null &&
            kill -0 -- "-$pid" 2>/dev/null; then
            log "$name: leader $pid gone, killing what is left of its group"
            kill -KILL -- "-$pid" 2>/dev/null || true
        else
            log "$name: not running (removing its pid file)"
        fi
    fi
    rm -f "$RUN_DIR/$name.pid" "$RUN_DIR/$name.env" "$RUN_DIR/$name.stopsignal"
}

# True while the service started last by this script is still alive (or when
# this script started nothing); lets the waits below fail fast on a crash.
_last_started_alive() {
    [[ -z $LAST_STARTED ]] || is_running "$LAST_STARTED"
}

# wait_until TIMEOUT_S cmd...: retry cmd (quietly) until it succeeds. Each try
# must end by itself (give probes their own timeouts).
wait_until() {
    local timeout=$1 deadline
    shift
    deadline=$((SECONDS + timeout))
    while true; do
        "$@" >/dev/null 2>&1 && return 0
        _last_started_alive || { log "$LAST_STARTED exited"; return 1; }
        ((SECONDS < deadline)) || return 1
        sleep 0.25
    done
}

_port_open() {
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

# wait_for_port HOST PORT TIMEOUT_S
wait_for_port() {
    wait_until "$3" _port_open "$1" "$2"
}

# port_in_use PORT: something already listens on 127.0.0.1:PORT.
port_in_use() {
    _port_open 127.0.0.1 "$1"
}

# emit_env NAME KEY=VALUE...: write $RUN_DIR/NAME.env and print the lines.
emit_env() {
    local name=$1
    shift
    printf '%s\n' "$@" >"$RUN_DIR/$name.env.tmp"
    mv "$RUN_DIR/$name.env.tmp" "$RUN_DIR/$name.env"
    printf '%s\n' "$@"
}

# already_up NAME probe_cmd...: if NAME runs, answers the probe and has an env
# file, re-print its env and succeed. If it runs but does not answer within
# ${ALREADY_UP_WAIT_S:-15} s (it may still be starting), stop it and fail so
# the caller starts it afresh.
already_up() {
    local name=$1
    shift
    is_running "$name" || return 1
    if [[ -s $RUN_DIR/$name.env ]] && { "$@" >/dev/null 2>&1 ||
        LAST_STARTED=$name wait_until "${ALREADY_UP_WAIT_S:-15}" "$@"; }; then
        log "$name already running"
        cat "$RUN_DIR/$name.env"
        return 0
    fi
    log "$name runs but does not answer: restarting it"
    stop_service "$name"
    return 1
}

# die msg: print msg and the tail of the log of the service being started to
# stderr (if this run wrote that log), stop that half-started service, exit 1.
die() {
    local name=${LAST_STARTED:-${SERVICE:-}}
    log "ERROR: $*"
    if [[ -n $name && -s $RUN_DIR/$name.log ]] &&
        (($(stat -c %Y "$RUN_DIR/$name.log") >= _LIB_T0)); then
        log "last lines of $RUN_DIR/$name.log:"
        tail -n "${DIE_LOG_LINES:-40}" "$RUN_DIR/$name.log" >&2
    fi
    if [[ -n $LAST_STARTED ]]; then
        STOP_TIMEOUT_S=5 stop_service "$LAST_STARTED" || true
    fi
    exit 1
}

# fresh_data_dir NAME: empty $RUN_DIR/NAME-data and print its path.
fresh_data_dir() {
    local dir="$RUN_DIR/$1-data"
    rm -rf "$dir"
    mkdir -p "$dir"
    echo "$dir"
}

# apt_install PKG...: install Debian packages without letting their services start.
apt_install() {
    local policy=/usr/sbin/policy-rc.d added=
    [[ $EUID -eq 0 ]] || die "need root to apt-get install $*"
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && added=1
    fi
    log "apt-get install $*"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2; then
        apt-get update -q >&2 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2 || {
            [[ -z $added ]] || rm -f "$policy"
            die "apt-get install $* failed"
        }
    fi
    [[ -z $added ]] || rm -f "$policy"
}

# test_certs: makes (once per $RUN_DIR) a throwaway CA and, signed by it, a server certificate
# for 127.0.0.1 / localhost and a client certificate (CN=onceflow-client) for mTLS, plus a
# second CA that signed nothing (the "untrusted CA" of the wrong-CA tests). Never committed:
# generated at test time with openssl. Prints the directory, which holds
#   ca.pem ca.key  server.pem server.key  server-chain.pem (server cert + CA)
#   server.p12 (server key + chain, PKCS#12, password in keystore.pass: for Java brokers)
#   truststore.p12 (the CA, same password)  client.pem client.key  client.p12
#   other-ca.pem (a CA unrelated to the certificates above)
test_certs() {
    local dir="$RUN_DIR/certs" pass lock
    mkdir -p "$dir"
    # One maker at a time: services started in parallel share these files.
    exec {lock}>"$RUN_DIR/certs.lock"
    flock "$lock"
    if [[ -s $dir/.complete ]]; then
        exec {lock}>&-
        echo "$dir"
        return 0
    fi
    command -v openssl >/dev/null || apt_install openssl
    (
        set -e
        cd "$dir"
        rm -f ./*.pem ./*.key ./*.p12 ./*.csr ./*.srl ./*.ext keystore.pass
        exec 2>/dev/null >&2
        pass=$(openssl rand -hex 12)
        printf '%s' "$pass" >keystore.pass
        openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=onceflow test CA" \
            -keyout ca.key -out ca.pem \
            -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
        openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=onceflow untrusted CA" \
            -keyout other-ca.key -out other-ca.pem \
            -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
        printf '%s\n' "subjectAltName=IP:127.0.0.1,DNS:localhost" \
            "extendedKeyUsage=serverAuth,clientAuth" "basicConstraints=CA:FALSE" >server.ext
        openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
            -extfile server.ext -out server.pem
        printf '%s\n' "extendedKeyUsage=clientAuth" "basicConstraints=CA:FALSE" >client.ext
        openssl req -newkey rsa:2048 -nodes -subj "/CN=onceflow-client" -keyout client.key \
            -out client.csr
        openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
            -extfile client.ext -out client.pem
        cat server.pem ca.pem >server-chain.pem
        openssl pkcs12 -export -in server.pem -inkey server.key -certfile ca.pem -name server \
            -passout "pass:$pass" -out server.p12
        openssl pkcs12 -export -in client.pem -inkey client.key -certfile ca.pem -name client \
            -passout "pass:$pass" -out client.p12
        # A truststore holding only the CA: keytool makes a PKCS#12 trust entry Java reads.
        keytool -importcert -noprompt -alias ca -file ca.pem -storetype PKCS12 \
            -keystore truststore.p12 -storepass "$pass"
        chmod 600 ./*.key keystore.pass
        rm -f ./*.csr ./*.srl ./*.ext
    ) || true
    # (set -e does not act inside a subshell on the left of ||: check what it made instead.)
    local f
    for f in ca.pem server.pem server.key server-chain.pem server.p12 truststore.p12 client.pem \
        client.key client.p12 other-ca.pem keystore.pass; do
        [[ -s $dir/$f ]] || {
            exec {lock}>&-
            log "ERROR: making test certificates in $dir failed ($f)"
            return 1
        }
    done
    date +%s >"$dir/.complete"
    exec {lock}>&-
    echo "$dir"
}

# ---- Apache Kafka: what tests/brokers/kafka/up.sh and tests/brokers/kafka-cluster share ----
# The jars of tests/brokers/kafka/pom.xml, resolved by Maven into $KAFKA_LIBS once per pom.xml
# content; the JVM from ONCEFLOW_KAFKA_JAVA, else $JAVA_HOME/bin/java, else `java` on PATH.
KAFKA_LIBS="$CACHE_DIR/kafka/libs"
KAFKA_JAVA=${ONCEFLOW_KAFKA_JAVA:-${JAVA_HOME:+$JAVA_HOME/bin/}java}

# kafka_api_versions PORT: a real Kafka request over bash's /dev/tcp (ApiVersions v0,
# correlation id 42) to 127.0.0.1:PORT; the broker must answer with that correlation id.
kafka_api_versions() {
    local reply
    exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
    printf '\x00\x00\x00\x10\x00\x12\x00\x00\x00\x00\x00\x2a\x00\x06probe1' >&3
    reply=$(timeout 3 head -c 8 <&3 | od -An -tx1 | tr -d ' \n')
    exec 3<&-
    [[ ${reply:8:8} == 0000002a ]]
}

# kafka_libs: checks for Java, resolves the Kafka jars into $KAFKA_LIBS if pom.xml changed since
# the last resolution (Maven's log in $CACHE_DIR/kafka/mvn.log), and prints the Kafka version
# (from the kafka_2.13-VERSION.jar among them).
kafka_libs() {
    local pom="$BROKERS_DIR/kafka/pom.xml" pom_sum tmp kafka_jar version
    command -v "$KAFKA_JAVA" >/dev/null || die "java not found (need Java 17+; set JAVA_HOME)"
    pom_sum=$(sha256sum "$pom" | cut -d' ' -f1)
    if [[ ! -f $KAFKA_LIBS/.pom.sha256 || $(<"$KAFKA_LIBS/.pom.sha256") != "$pom_sum" ]]; then
        command -v mvn >/dev/null || die "mvn not found (apt-get install maven)"
        log "resolving Kafka jars with Maven into $KAFKA_LIBS"
        tmp="$KAFKA_LIBS.tmp.$$"
        rm -rf "$tmp"
        mkdir -p "$CACHE_DIR/kafka"
        if ! mvn -B -f "$pom" dependency:copy-dependencies -DoutputDirectory="$tmp" \
            >"$CACHE_DIR/kafka/mvn.log" 2>&1; then
            tail -n 40 "$CACHE_DIR/kafka/mvn.log" >&2
            rm -rf "$tmp"
            die "mvn dependency:copy-dependencies failed (log: $CACHE_DIR/kafka/mvn.log)"
        fi
        echo "$pom_sum" >"$tmp/.pom.sha256"
        rm -rf "$KAFKA_LIBS"
        mv "$tmp" "$KAFKA_LIBS"
    fi
    kafka_jar=$(find "$KAFKA_LIBS" -maxdepth 1 -name 'kafka_2.13-*.jar' | head -n 1)
    [[ -n $kafka_jar ]] || die "no kafka_2.13 jar in $KAFKA_LIBS"
    version=${kafka_jar##*/kafka_2.13-}
    echo "${version%.jar}"
}

# kafka_log4j_conf LEVEL: a log4j2 configuration printing to the console at LEVEL (request
# and state-change loggers at WARN).
kafka_log4j_conf() {
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

# kafka_tool NAME MAIN_CLASS args...: runs a Kafka command-line tool (at most 90 s, small
# heap), logging at WARN through $RUN_DIR/NAME-tools-log4j2.properties.
kafka_tool() {
    local conf="$RUN_DIR/$1-tools-log4j2.properties"
    shift
    kafka_log4j_conf WARN >"$conf"
    timeout 90 "$KAFKA_JAVA" -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
        -Dlog4j2.configurationFile="$conf" -cp "$KAFKA_LIBS/*" "$@"
}
