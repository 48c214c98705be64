#!/usr/bin/env bash
# PostgreSQL (Debian's packages) on 127.0.0.1:${ONCEFLOW_POSTGRES_PORT:-15432}:
# database onceflow, user onceflow, password onceflow (scram-sha-256 over TCP,
# so wrong credentials fail). Runs as the postgres system user when we are root.
# fsync stays on: the store-restart tests rely on durability.
# ONCEFLOW_KEEP_DATA=1 keeps the data of the last run (restart.sh uses it).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SERVICE=postgres
PORT=${ONCEFLOW_POSTGRES_PORT:-15432}
USER_NAME=onceflow
PASSWORD=onceflow
DB=onceflow
URL="postgres://$USER_NAME:$PASSWORD@127.0.0.1:$PORT/$DB"
SOCK_DIR="$RUN_DIR/postgres-sock"

# Newest Debian server binaries (never a stray pg_ctl elsewhere on PATH).
find_bindir() {
    local d
    d=$(find /usr/lib/postgresql -mindepth 3 -maxdepth 3 -path '*/bin/initdb' 2>/dev/null |
        sort -V | tail -n 1)
    [[ -n $d ]] && dirname "$d"
}

probe() {
    PGCONNECT_TIMEOUT=3 timeout 5 "$BIN/psql" "$URL" -XAtqc 'select 1' 2>/dev/null | grep -qx 1
}

BIN=$(find_bindir || true)
if [[ -n $BIN ]] && already_up postgres probe; then exit 0; fi

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

keep=
if [[ ${ONCEFLOW_KEEP_DATA:-} == 1 && -s $RUN_DIR/postgres-data/PG_VERSION ]]; then
    data=$RUN_DIR/postgres-data
    keep=1
else
    data=$(fresh_data_dir postgres)
fi
rm -rf "$SOCK_DIR"
mkdir -p "$SOCK_DIR"
pwfile=$(mktemp "$RUN_DIR/postgres-pw.XXXXXX")
trap 'rm -f "$pwfile"' EXIT
echo "$PASSWORD" >"$pwfile"
if [[ $EUID -eq 0 ]]; then
    chown postgres: "$data" "$SOCK_DIR" "$pwfile"
    "${as_pg[@]}" test -w "$data" ||
        die "the postgres user cannot write $data: make $RUN_DIR reachable (ONCEFLOW_RUN_DIR)"
fi
chmod 700 "$data"

if [[ -z $keep ]]; then
    log "initdb ($("$BIN/postgres" --version)) in $data"
    "${as_pg[@]}" "$BIN/initdb" -D "$data" -U "$USER_NAME" --pwfile="$pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --no-locale \
        >"$RUN_DIR/postgres-initdb.log" 2>&1 ||
        { cat "$RUN_DIR/postgres-initdb.log" >&2; die "initdb failed"; }
fi
rm -f "$pwfile"

log "starting postgres on 127.0.0.1:$PORT"
# down.sh: SIGINT is postgres' "fast" shutdown (SIGTERM would wait for clients).
echo INT >"$RUN_DIR/postgres.stopsignal"
start_bg postgres "${as_pg[@]}" "$BIN/postgres" -D "$data" \
    -c listen_addresses=127.0.0.1 -c port="$PORT" -c unix_socket_directories="$SOCK_DIR" \
    -c shared_buffers=32MB -c max_connections=100 -c fsync=on -c synchronous_commit=on \
    -c logging_collector=off -c log_destination=stderr
wait_until 60 "$BIN/pg_isready" -q -t 3 -h 127.0.0.1 -p "$PORT" ||
    die "postgres not ready on port $PORT"
if [[ -z $keep ]]; then
    "$BIN/psql" -h "$SOCK_DIR" -p "$PORT" -U "$USER_NAME" -d postgres -XAtq \
        -c "create database $DB" >&2 || die "create database $DB failed"
fi
probe || die "cannot connect with $URL"
emit_env postgres "ONCEFLOW_POSTGRES_URL=$URL"
