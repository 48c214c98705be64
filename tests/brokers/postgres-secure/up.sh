#!/usr/bin/env bash
# PostgreSQL with SSL required and password authentication (issue 23): a second cluster of
# Debian's packages on 127.0.0.1:${ONCEFLOW_POSTGRES_SECURE_PORT:-15433}, next to the plain one
# (tests/brokers/postgres). ssl=on with the server certificate of test_certs (lib.sh:
# subjectAltName 127.0.0.1 and localhost); pg_hba.conf has only `hostssl` lines for TCP:
#   hostssl all onceflow-client 127.0.0.1/32 cert          (mTLS: the client certificate's CN)
#   hostssl all all             127.0.0.1/32 scram-sha-256 (user onceflow, password below)
# so a connection without TLS is refused (SQLSTATE 28000). The password of user `onceflow` is
# made afresh at each start (a new cluster each time). Runs as the postgres system user when we
# are root, like the plain script. No data kept between starts.
#
# Prints (the URL in single quotes: its `&` must survive `eval`):
#   ONCEFLOW_POSTGRES_SECURE_URL  postgres://onceflow:PASS@127.0.0.1:PORT/onceflow?sslmode=verify-full&sslrootcert=CA
#   ONCEFLOW_POSTGRES_SECURE_HOST, _PORT, _DB, _USER, _PASSWORD, _CA (ca.pem), _OTHER_CA (a CA
#   that signed nothing here), _CLIENT_USER (onceflow-client), _CLIENT_CERT, _CLIENT_KEY (the
#   client certificate, CN=onceflow-client, and its key).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SERVICE=postgres-secure
PORT=${ONCEFLOW_POSTGRES_SECURE_PORT:-15433}
USER_NAME=onceflow
CERT_USER=onceflow-client
DB=onceflow
SOCK_DIR="$RUN_DIR/postgres-secure-sock"
PASSFILE="$RUN_DIR/postgres-secure.pass"

CERTS=$(test_certs) || die "cannot make the test certificates"

# Newest Debian server binaries (never a stray pg_ctl elsewhere on PATH).
find_bindir() {
    local d
    d=$(find /usr/lib/postgresql -mindepth 3 -maxdepth 3 -path '*/bin/initdb' 2>/dev/null |
        sort -V | tail -n 1)
    [[ -n $d ]] && dirname "$d"
}

url() {
    echo "postgres://$USER_NAME:$1@127.0.0.1:$PORT/$DB?sslmode=verify-full&sslrootcert=$CERTS/ca.pem"
}

probe() {
    [[ -s $PASSFILE ]] || return 1
    PGCONNECT_TIMEOUT=3 PGPASSWORD=$(<"$PASSFILE") timeout 5 "$BIN/psql" \
        "host=127.0.0.1 port=$PORT dbname=$DB user=$USER_NAME sslmode=verify-full sslrootcert=$CERTS/ca.pem" \
        -XAtqc 'select 1' 2>/dev/null | grep -qx 1
}

BIN=$(find_bindir || true)
if [[ -n $BIN ]] && already_up postgres-secure probe; then exit 0; fi

if [[ -z $BIN ]]; then
    apt_install postgresql
    BIN=$(find_bindir) || die "no initdb under /usr/lib/postgresql/*/bin after install"
fi
port_in_use "$PORT" && die "port $PORT is taken by a process we did not start"

# initdb and postgres refuse to run as root.
as_pg=()
if [[ $EUID -eq 0 ]]; then
    id -u postgres >/dev/null 2>&1 ||
        useradd --system --user-group --no-create-home --home-dir /nonexistent postgres
    as_pg=(setpriv --reuid=postgres --regid=postgres --init-groups --reset-env)
fi

data=$(fresh_data_dir postgres-secure)
rm -rf "$SOCK_DIR"
mkdir -p "$SOCK_DIR"
(umask 077 && openssl rand -hex 16 >"$PASSFILE")
pwfile=$(mktemp "$RUN_DIR/postgres-secure-pw.XXXXXX")
trap 'rm -f "$pwfile"' EXIT
cat "$PASSFILE" >"$pwfile"
if [[ $EUID -eq 0 ]]; then
    chown postgres: "$data" "$SOCK_DIR" "$pwfile"
    "${as_pg[@]}" test -w "$data" ||
        die "the postgres user cannot write $data: make $RUN_DIR reachable (ONCEFLOW_RUN_DIR)"
fi
chmod 700 "$data"

log "initdb ($("$BIN/postgres" --version)) in $data"
"${as_pg[@]}" "$BIN/initdb" -D "$data" -U "$USER_NAME" --pwfile="$pwfile" \
    --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --no-locale \
    >"$RUN_DIR/postgres-secure-initdb.log" 2>&1 ||
    { cat "$RUN_DIR/postgres-secure-initdb.log" >&2; die "initdb failed"; }
rm -f "$pwfile"

# The server's key and certificates inside the data directory, readable by the postgres user
# only (postgres refuses a key file others can read).
cp "$CERTS/server.pem" "$data/server.crt"
cp "$CERTS/server.key" "$data/server.key"
cp "$CERTS/ca.pem" "$data/root.crt"
chmod 600 "$data/server.key"
# Only TLS connections over TCP; the Unix socket (trust) is for this script's setup.
cat >"$data/pg_hba.conf" <<EOF
local   all  all                          trust
hostssl all  $CERT_USER  127.0.0.1/32     cert
hostssl all  all         127.0.0.1/32     scram-sha-256
EOF
if [[ $EUID -eq 0 ]]; then
    chown postgres: "$data/server.crt" "$data/server.key" "$data/root.crt" "$data/pg_hba.conf"
fi

log "starting postgres with ssl=on on 127.0.0.1:$PORT"
# down.sh: SIGINT is postgres' "fast" shutdown (SIGTERM would wait for clients).
echo INT >"$RUN_DIR/postgres-secure.stopsignal"
start_bg postgres-secure "${as_pg[@]}" "$BIN/postgres" -D "$data" \
    -c listen_addresses=127.0.0.1 -c port="$PORT" -c unix_socket_directories="$SOCK_DIR" \
    -c shared_buffers=16MB -c max_connections=50 -c fsync=off -c synchronous_commit=off \
    -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key -c ssl_ca_file=root.crt \
    -c password_encryption=scram-sha-256 \
    -c logging_collector=off -c log_destination=stderr
wait_until 60 "$BIN/pg_isready" -q -t 3 -h "$SOCK_DIR" -p "$PORT" ||
    die "postgres-secure not ready on port $PORT"
"$BIN/psql" -h "$SOCK_DIR" -p "$PORT" -U "$USER_NAME" -d postgres -XAtq \
    -c "create database $DB" \
    -c "create role \"$CERT_USER\" login" \
    -c "grant all on database $DB to \"$CERT_USER\"" >&2 || die "creating database $DB failed"
probe || die "cannot connect with TLS (verify-full) and the password to 127.0.0.1:$PORT"
pass=$(<"$PASSFILE")
emit_env postgres-secure \
    "ONCEFLOW_POSTGRES_SECURE_URL='$(url "$pass")'" \
    "ONCEFLOW_POSTGRES_SECURE_HOST=127.0.0.1" \
    "ONCEFLOW_POSTGRES_SECURE_PORT=$PORT" \
    "ONCEFLOW_POSTGRES_SECURE_DB=$DB" \
    "ONCEFLOW_POSTGRES_SECURE_USER=$USER_NAME" \
    "ONCEFLOW_POSTGRES_SECURE_PASSWORD=$pass" \
    "ONCEFLOW_POSTGRES_SECURE_CA=$CERTS/ca.pem" \
    "ONCEFLOW_POSTGRES_SECURE_OTHER_CA=$CERTS/other-ca.pem" \
    "ONCEFLOW_POSTGRES_SECURE_CLIENT_USER=$CERT_USER" \
    "ONCEFLOW_POSTGRES_SECURE_CLIENT_CERT=$CERTS/client.pem" \
    "ONCEFLOW_POSTGRES_SECURE_CLIENT_KEY=$CERTS/client.key"
