#!/usr/bin/env bash
# A Rust user's crate outside the workspace: README.md's "Rust quick start" (its
# `[dependencies]` block and its `main.rs`, taken from the README as it is) in a new crate in a
# temp dir that depends on onceflow by path with `default-features = false` and one platform
# feature, built and run against a real broker.
#
#   tests/packaging/rust-user-crate.sh FEATURE URL      e.g. kafka kafka://127.0.0.1:19092
#
# The run must print "charging for order #1" once; then SIGINT (the quick start's ctrl_c) ends
# it and its summary must say one message was processed. The topic and group names of the quick
# start ("orders", "billing") get a unique suffix so reruns on the same broker stay independent.
# The workspace's Cargo.lock is copied in (cargo prunes what the crate does not use), so the
# crate builds the versions CI tests and reuses the workspace target dir's dependencies.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
feature=${1:?usage: rust-user-crate.sh FEATURE URL}
url=${2:?usage: rust-user-crate.sh FEATURE URL}
packaging_test "rust-user-crate $feature"
pid=
# packaging_test's own EXIT trap removes $dir; this one also ends the crate's run if it is left.
cleanup() {
    [[ -n $pid ]] && kill -9 "$pid" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT

deps=$(readme_block "Rust quick start" toml)
code=$(readme_block "Rust quick start" rust)
[[ $deps == *'onceflow = { version = "0.1"'* ]] || fail "README's toml block has no onceflow dependency: $deps"
[[ $code == *'async fn main'* ]] || fail "README's rust block has no main: $code"

suffix=$(date +%s)-$$
mkdir -p "$dir/src"
{
    printf '[package]\nname = "onceflow-user-%s"\nversion = "0.0.0"\nedition = "2021"\npublish = false\n\n' "$feature"
    # The published version requirement becomes the checkout's path; the features are this run's.
    printf '%s\n' "$deps" | sed -E \
        -e "s#onceflow = \\{ version = \"0\\.1\"#onceflow = { path = \"$root\"#" \
        -e "s#features = \\[\"kafka\"\\]#features = [\"$feature\"]#"
    # Not a member of the onceflow workspace it sits under (when TMPDIR is inside the checkout).
    printf '\n[workspace]\n'
} >"$dir/Cargo.toml"
printf '%s\n' "$code" | sed -e "s/\"orders\"/\"orders-$suffix\"/g" -e "s/\"billing\"/\"billing-$suffix\"/" \
    >"$dir/src/main.rs"
cp "$root/Cargo.lock" "$dir/Cargo.lock"

start=$(date +%s)
log "building $(grep -o 'onceflow = {[^}]*}' "$dir/Cargo.toml") in $dir"
(cd "$dir" && cargo build --quiet) || fail "the crate does not build"
log "built in $(($(date +%s) - start))s; running it against $url"

out="$dir/run.log"
(cd "$dir" && ONCEFLOW_URL="$url" exec "$CARGO_TARGET_DIR/debug/onceflow-user-$feature") >"$out" 2>&1 &
pid=$!
for _ in $(seq 1 1200); do
    grep -q 'charging for order #1' "$out" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
done
grep -q 'charging for order #1' "$out" || fail "no 'charging for order #1' within 120 s: $(cat "$out")"
sleep 1
kill -INT "$pid"
for _ in $(seq 1 300); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$pid" 2>/dev/null; then
    fail "still running 30 s after SIGINT: $(cat "$out")"
fi
wait "$pid" || fail "exit code $? after SIGINT: $(cat "$out")"
pid=
expect_once "$out" 'charging for order #1' || fail "the order was not charged once"
grep -q 'processed: 1,' "$out" || fail "the summary does not say one message was processed: $(cat "$out")"
log "OK: $(tail -n 1 "$out")"
