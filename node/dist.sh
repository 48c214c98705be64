#!/usr/bin/env bash
# Builds the tarball users install with `npm install onceflow`: the package with the native
# addon for this platform prebuilt inside it (`onceflow.<platform>-<arch>.node`, the napi-rs
# "binary in the package" layout), so installing it runs no cargo. Every backend and store is
# compiled in.
#
#   node/dist.sh [--profile release|dev] [--out DIR]      (default: release, dist/node)
#
# Prints the tarball's path on stdout and its size on stderr. `make dist` runs it; the
# packaging test (tests/packaging/node-tarball.sh) runs it with `--profile dev` to reuse the
# test build.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
DIST_NAME=node/dist.sh DIST_DEFAULT_OUT=$root/dist/node
# shellcheck source=../tools/dist-args.sh
source "$root/tools/dist-args.sh"
flags=()
[[ $profile == dev ]] && flags=(--debug)
log() { printf '[node dist] %s\n' "$*" >&2; }

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
export npm_config_cache=${ONCEFLOW_NPM_CACHE:-$HOME/.cache/onceflow/npm}
log "building the $profile addon (target dir $CARGO_TARGET_DIR)"
(cd "$here" && node scripts/build.js --force --strip "${flags[@]}" >&2)
rm -rf "$out"
mkdir -p "$out"
tarball=$(cd "$here" && npm pack --silent --pack-destination "$out")
tarball=$out/$(tail -n 1 <<<"$tarball")
[[ -f $tarball ]] || { log "npm pack made no tarball in $out"; exit 1; }
binary="onceflow.$(node -p 'process.platform + "-" + process.arch').node"
# The listing first: `grep -q` stops reading at the first match, and under pipefail the
# SIGPIPE that then ends tar would fail the check.
listing=$(tar -tzf "$tarball")
grep -qx "package/$binary" <<<"$listing" || { log "$tarball lacks package/$binary"; exit 1; }
log "$(basename "$tarball"): $(du -h "$tarball" | cut -f1) ($(stat -c %s "$tarball") bytes), with $binary"
echo "$tarball"
