#!/usr/bin/env bash
# The wheel `pip install onceflow` users get, installed without Rust: python/dist.sh builds it,
# a fresh venv installs it from the file alone (no index, no sdist, no cargo or rustc on PATH),
# and README.md's Python quick start runs as the README has it on memory://, then on each broker
# URL given (its "memory://quickstart" replaced by the URL, its topic and group names made
# unique). Each run must charge order #1 once and report one processed order.
#
#   tests/packaging/python-wheel.sh [URL...]     e.g. kafka://127.0.0.1:19092 nats://127.0.0.1:14222
#
# ONCEFLOW_DIST_PROFILE (default dev, the profile the Python tests already built) picks the
# wheel's cargo profile; `make dist` builds the release one.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
packaging_test python-wheel
wheel=$("$root/python/dist.sh" --profile "${ONCEFLOW_DIST_PROFILE:-dev}" --out "$CARGO_TARGET_DIR/dist-test/python")

"${PYTHON:-python3}" -m venv "$dir/venv"
PATH=$bare_path "$dir/venv/bin/python" -m pip install -q --disable-pip-version-check --no-index "$wheel" ||
    fail "pip could not install $(basename "$wheel") without Rust"
log "installed $(basename "$wheel") into a fresh venv, no cargo on PATH"

code=$(readme_block "Python" python)
[[ $code == *'memory://quickstart'* ]] || fail "README's Python block has no memory://quickstart: $code"

for url in memory://quickstart "$@"; do
    suffix=$(date +%s%N)
    printf '%s\n' "$code" | sed -e "s#memory://quickstart#$url#" \
        -e "s/\"orders\"/\"orders-$suffix\"/g" -e "s/\"billing\"/\"billing-$suffix\"/g" >"$dir/quickstart.py"
    (cd "$dir" && PATH=$bare_path timeout 120 "$dir/venv/bin/python" quickstart.py) >"$dir/out.txt" 2>&1 ||
        fail "the quick start on $url failed (exit $?): $(cat "$dir/out.txt")"
    expect_once "$dir/out.txt" 'charging for order #1' || fail "on $url"
    grep -q '^1 processed, ' "$dir/out.txt" || fail "no '1 processed, ...' line on $url: $(cat "$dir/out.txt")"
    log "OK on $url: $(tail -n 1 "$dir/out.txt")"
done
