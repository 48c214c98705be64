#!/usr/bin/env bash
# Redis over TLS only, with an ACL user and the default user disabled (issue 23): Debian's
# redis-server on 127.0.0.1:${ONCEFLOW_REDIS_SECURE_PORT:-16380} (and 127.0.0.2, same port,
# where the server certificate's names do not match: the hostname-mismatch tests), no plain
# port (--port 0). Certificates from test_certs (lib.sh): the server presents server.pem;
# clients may present a certificate (tls-auth-clients optional), which must then be signed by
# ca.pem. The ACL user `onceflow` gets a password made afresh at each start.
#
# Prints (rediss:// URLs, see adapters/redis for the `ca`, `cert`, `key` options; the URL in
# single quotes, for `eval`):
#   ONCEFLOW_REDIS_SECURE_URL     rediss://onceflow:PASS@127.0.0.1:PORT/?ca=CA (works as is)
#   ONCEFLOW_REDIS_SECURE_HOST, _PORT, _USER, _PASSWORD, _CA (ca.pem), _OTHER_CA (a CA that
#   signed nothing here), _CLIENT_CERT, _CLIENT_KEY (signed by the CA), _ROGUE_CERT,
#   _ROGUE_KEY (a client certificate signed by the other CA, which the server refuses),
#   _MISMATCH_HOST (127.0.0.2: reachable, not named in the server certificate).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SERVICE=redis-secure
PORT=${ONCEFLOW_REDIS_SECURE_PORT:-16380}
USER_NAME=onceflow
PASSFILE="$RUN_DIR/redis-secure.pass"

CERTS=$(test_certs) || die "cannot make the test certificates"

probe() {
    [[ -s $PASSFILE ]] || return 1
    [[ $(REDISCLI_AUTH=$(<"$PASSFILE") timeout 3 redis-cli --tls --cacert "$CERTS/ca.pem" \
        -h 127.0.0.1 -p "$PORT" --user "$USER_NAME" --no-auth-warning ping 2>/dev/null) == PONG ]]
}

print_env() {
    local pass
    pass=$(<"$PASSFILE")
    emit_env redis-secure \
        "ONCEFLOW_REDIS_SECURE_URL='rediss://$USER_NAME:$pass@127.0.0.1:$PORT/?ca=$CERTS/ca.pem'" \
        "ONCEFLOW_REDIS_SECURE_HOST=127.0.0.1" \
        "ONCEFLOW_REDIS_SECURE_PORT=$PORT" \
        "ONCEFLOW_REDIS_SECURE_USER=$USER_NAME" \
        "ONCEFLOW_REDIS_SECURE_PASSWORD=$pass" \
        "ONCEFLOW_REDIS_SECURE_CA=$CERTS/ca.pem" \
        "ONCEFLOW_REDIS_SECURE_OTHER_CA=$CERTS/other-ca.pem" \
        "ONCEFLOW_REDIS_SECURE_CLIENT_CERT=$CERTS/client.pem" \
        "ONCEFLOW_REDIS_SECURE_CLIENT_KEY=$CERTS/client.key" \
        "ONCEFLOW_REDIS_SECURE_ROGUE_CERT=$DATA/rogue-client.pem" \
        "ONCEFLOW_REDIS_SECURE_ROGUE_KEY=$DATA/rogue-client.key" \
        "ONCEFLOW_REDIS_SECURE_MISMATCH_HOST=127.0.0.2"
}

DATA=$RUN_DIR/redis-secure-data
already_up redis-secure probe && exit 0

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    apt_install redis-server
fi
port_in_use "$PORT" && die "port $PORT is taken by a process we did not start"

DATA=$(fresh_data_dir redis-secure)
chmod 700 "$DATA"
# A client certificate from a CA the server does not trust: presented, it must be refused.
(
    cd "$DATA"
    exec >/dev/null 2>&1
    openssl req -newkey rsa:2048 -nodes -subj "/CN=onceflow-rogue-client" \
        -keyout rogue-client.key -out rogue-client.csr
    printf '%s\n' "extendedKeyUsage=clientAuth" "basicConstraints=CA:FALSE" >rogue.ext
    openssl x509 -req -in rogue-client.csr -CA "$CERTS/other-ca.pem" \
        -CAkey "$CERTS/other-ca.key" -CAcreateserial -days 30 -extfile rogue.ext \
        -out rogue-client.pem
    rm -f rogue-client.csr rogue.ext ./*.srl
    chmod 600 rogue-client.key
) || die "cannot make the rogue client certificate"

(umask 077 && openssl rand -hex 16 >"$PASSFILE")
pass=$(<"$PASSFILE")
conf="$DATA/redis.conf"
# The password goes in a file only we can read, not on the command line.
(
    umask 077
    cat >"$conf" <<EOF
port 0
tls-port $PORT
bind 127.0.0.1 -127.0.0.2
protected-mode yes
tls-cert-file $CERTS/server.pem
tls-key-file $CERTS/server.key
tls-ca-cert-file $CERTS/ca.pem
tls-auth-clients optional
dir $DATA
save ""
appendonly no
daemonize no
logfile ""
user default off
user $USER_NAME on >$pass ~* &* +@all
EOF
)

log "starting $(redis-server --version | awk '{print $1, $2, $3}') with TLS on 127.0.0.1:$PORT"
start_bg redis-secure redis-server "$conf"
wait_until 30 probe || die "redis-secure did not answer PING over TLS on port $PORT"
print_env
