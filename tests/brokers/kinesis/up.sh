#!/usr/bin/env bash
# Start a Kinesis-compatible server (kinesis-local, the npm build of kinesis-mock)
# on loopback for the tests. Prints only KEY=VALUE lines on stdout:
#   ONCEFLOW_KINESIS_URL=kinesis://127.0.0.1:14567?region=us-east-1
#   ONCEFLOW_KINESIS_ENDPOINT=http://127.0.0.1:14567   (endpoint_url for AWS SDKs)
# Plain HTTP on ONCEFLOW_KINESIS_PORT (14567), HTTPS with the package's
# self-signed certificate on ONCEFLOW_KINESIS_TLS_PORT (14568). Any credentials
# are accepted, but requests must carry an Authorization and an X-Amz-Date header.
# State is in memory only. Server settings (e.g. CREATE_STREAM_DURATION=500ms,
# SHARD_LIMIT, LOG_LEVEL=INFO) are read from the environment as given. SHARD_LIMIT defaults
# to 2000 here (the server's own default, 50, is used up by one run of the test suites, which
# create a stream per case).
# The package is installed with npm (package.json + package-lock.json here)
# into $CACHE_DIR/kinesis, once.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$HERE/../lib.sh"

PORT=${ONCEFLOW_KINESIS_PORT:-14567}
TLS_PORT=${ONCEFLOW_KINESIS_TLS_PORT:-14568}
REGION=${ONCEFLOW_KINESIS_REGION:-us-east-1}
START_TIMEOUT_S=${ONCEFLOW_KINESIS_START_TIMEOUT_S:-60}
INSTALL=$CACHE_DIR/kinesis
PKG=$INSTALL/node_modules/kinesis-local

answers() {
    curl -sf -m 5 -o /dev/null -X POST "http://127.0.0.1:$PORT/" \
        -H 'X-Amz-Target: Kinesis_20131202.ListStreams' \
        -H 'Content-Type: application/x-amz-json-1.1' \
        -H "X-Amz-Date: $(date -u +%Y%m%dT%H%M%SZ)" \
        -H "Authorization: AWS4-HMAC-SHA256 Credential=onceflow/20240101/$REGION/kinesis/aws4_request, SignedHeaders=host;x-amz-date, Signature=0" \
        -d '{}'
}

if already_up kinesis answers; then
    exit 0
fi

command -v node >/dev/null || die "node not found: kinesis-local needs Node.js"

# --- install (cached; reinstalled when package.json or the lock file changes) ----
LOCK_SUM=$(cat "$HERE/package.json" "$HERE/package-lock.json" | sha256sum | cut -d' ' -f1)
if [[ $(cat "$INSTALL/.lock.sha256" 2>/dev/null) != "$LOCK_SUM" || ! -f $PKG/main.js ]]; then
    mkdir -p "$INSTALL"
    exec {dl_lock}>"$INSTALL/.lock"
    flock "$dl_lock"
    if [[ $(cat "$INSTALL/.lock.sha256" 2>/dev/null) != "$LOCK_SUM" || ! -f $PKG/main.js ]]; then
        command -v npm >/dev/null || die "npm not found: needed once to install kinesis-local"
        log "installing kinesis-local from the npm registry into $INSTALL (once)"
        rm -f "$INSTALL/.lock.sha256"
        cp "$HERE/package.json" "$HERE/package-lock.json" "$INSTALL/"
        (cd "$INSTALL" && npm ci --no-audit --no-fund --loglevel=error >&2) ||
            die "npm could not install kinesis-local"
        echo "$LOCK_SUM" >"$INSTALL/.lock.sha256"
    fi
    exec {dl_lock}>&-
fi

# --- start ----------------------------------------------------------------------
for p in "$PORT" "$TLS_PORT"; do
    ! port_in_use "$p" || die "port $p on 127.0.0.1 is already in use (not by our kinesis)"
done

DATA=$(fresh_data_dir kinesis)
log "starting kinesis-local $(node -p "require('$PKG/package.json').version")"
# main.js finds its certificate (server.json) relative to the working directory.
cd "$PKG"
SHARD_LIMIT=${SHARD_LIMIT:-2000} \
    KINESIS_MOCK_PLAIN_PORT=$PORT \
    KINESIS_MOCK_TLS_PORT=$TLS_PORT \
    KINESIS_MOCK_CERT_PATH=$PKG/server.json \
    AWS_REGION=$REGION \
    SHOULD_PERSIST_DATA=false \
    PERSIST_PATH=$DATA \
    start_bg kinesis node -r "$HERE/loopback.js" "$PKG/main.js"

wait_until "$START_TIMEOUT_S" answers ||
    die "kinesis-local exited, or did not answer ListStreams within ${START_TIMEOUT_S}s"
log "kinesis ready after ${SECONDS}s"

emit_env kinesis \
    "ONCEFLOW_KINESIS_URL=kinesis://127.0.0.1:$PORT?region=$REGION" \
    "ONCEFLOW_KINESIS_ENDPOINT=http://127.0.0.1:$PORT"
