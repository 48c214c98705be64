#!/usr/bin/env bash
# The tarball `npm install onceflow` users get, installed without Rust: node/dist.sh packs it
# with its prebuilt native addon, an empty project installs it from the file alone (no cargo or
# rustc on PATH; the install script must find the prebuilt addon), and README.md's Node quick
# start runs as the README has it on memory://, then on each broker URL given (its
# "memory://quickstart" replaced by the URL, its topic and group names made unique, and its
# one-second stop timer given 20 s, since joining a broker's consumer group takes seconds).
# Each run must charge order #1 once and report one processed order.
#
#   tests/packaging/node-tarball.sh [URL...]     e.g. kafka://127.0.0.1:19092 nats://127.0.0.1:14222
#
# ONCEFLOW_DIST_PROFILE (default dev, the profile the Node tests already built) picks the
# addon's cargo profile; `make dist` builds the release one.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
packaging_test node-tarball
export npm_config_cache=${ONCEFLOW_NPM_CACHE:-$HOME/.cache/onceflow/npm}
tarball=$("$root/node/dist.sh" --profile "${ONCEFLOW_DIST_PROFILE:-dev}" --out "$CARGO_TARGET_DIR/dist-test/node")

mkdir -p "$dir/app"
(cd "$dir/app" && npm init -y >/dev/null &&
    PATH=$bare_path npm install --no-audit --no-fund --loglevel=error "$tarball" >"$dir/install.txt" 2>&1) ||
    fail "npm could not install $(basename "$tarball") without Rust: $(cat "$dir/install.txt")"
log "installed $(basename "$tarball") into an empty project, no cargo on PATH"

code=$(readme_block "Node" js)
[[ $code == *"memory://quickstart"* ]] || fail "README's Node block has no memory://quickstart: $code"

for url in memory://quickstart "$@"; do
    suffix=$(date +%s%N)
    script=$(printf '%s\n' "$code" | sed -e "s/'orders'/'orders-$suffix'/g" -e "s/'billing'/'billing-$suffix'/g")
    if [[ $url != memory://* ]]; then
        script=$(printf '%s\n' "$script" | sed -e "s#memory://quickstart#$url#" \
            -e 's/setTimeout(() => billing.stop(), 1000)/setTimeout(() => billing.stop(), 20000)/')
    fi
    printf '%s\n' "$script" >"$dir/app/quickstart.js"
    (cd "$dir/app" && PATH=$bare_path timeout 120 node quickstart.js) >"$dir/out.txt" 2>&1 ||
        fail "the quick start on $url failed (exit $?): $(cat "$dir/out.txt")"
    expect_once "$dir/out.txt" 'charging for order #1' || fail "on $url"
    # The retry is a duplicate the consumer skips, or one the platform itself dropped
    # (JetStream's Nats-Msg-Id window): skipped 1 or 0, processed 1 either way.
    grep -qE '^processed 1, duplicates skipped [01]$' "$dir/out.txt" ||
        fail "no 'processed 1, duplicates skipped 0|1' line on $url: $(cat "$dir/out.txt")"
    log "OK on $url: $(tail -n 1 "$dir/out.txt")"
done
