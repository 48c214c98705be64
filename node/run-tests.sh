#!/usr/bin/env bash
# The Node package's tests: npm dependencies installed with ~/.cache/onceflow/npm as npm's
# cache, the addon built once by cargo (debug profile, a reused target dir), then
# `node --test` on node/test. Broker tests run when ONCEFLOW_KAFKA_URL / ONCEFLOW_NATS_URL
# are set (tests/run-all.sh sets them). Exits non-zero on any failure, and when no test ran.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
log() { printf '[node] %s\n' "$*" >&2; }

command -v node >/dev/null || { log "node is not installed"; exit 1; }
export npm_config_cache=${ONCEFLOW_NPM_CACHE:-$HOME/.cache/onceflow/npm}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
cd "$here"

log "installing npm dependencies (cache $npm_config_cache)"
# --ignore-scripts: the addon is built below, once, in the debug profile.
npm ci --ignore-scripts --no-audit --no-fund --prefer-offline --loglevel=error

start=$(date +%s)
log "building the addon (target dir $CARGO_TARGET_DIR)"
node scripts/build.js --force --debug
log "addon built in $(( $(date +%s) - start ))s"

set +e
timeout 1800 node --test --test-timeout=300000 --test-reporter=tap test/*.test.js "$@" | tee "$CARGO_TARGET_DIR/node-test-output.tap"
rc=${PIPESTATUS[0]}
set -e
pass=$(grep -cE '^ok [0-9]+' "$CARGO_TARGET_DIR/node-test-output.tap" || true)
fail=$(grep -cE '^not ok [0-9]+' "$CARGO_TARGET_DIR/node-test-output.tap" || true)
log "node --test: $pass ok, $fail not ok (exit $rc)"
if [[ $rc -eq 0 && $pass -eq 0 ]]; then
    log "no test ran: failing"
    exit 1
fi
exit "$rc"
