#!/usr/bin/env bash
# The crates as crates.io would get them: every published crate's `cargo package --list` holds
# its sources, Cargo.toml, README.md and LICENSE and nothing of the tests, benches or test data;
# every version is the workspace's and every onceflow dependency asks for it; and
# `cargo publish --dry-run` of all of them, in dependency order (cargo's multi-package publish
# resolves the unpublished onceflow crates locally), passes. The dry run packages without
# building (`--no-verify`: a verified build of nine crates from scratch takes longer than CI
# has); ONCEFLOW_PACKAGE_VERIFY=1 builds each packaged crate as crates.io users would.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PACKAGING_ROOT"
log() { printf '[cargo-package] %s\n' "$*" >&2; }
fail() { log "FAILED: $*"; exit 1; }

# Published crates, in dependency order.
crates=(onceflow-core onceflow-memory onceflow-kafka onceflow-jetstream onceflow-kinesis
    onceflow-pulsar onceflow-redis onceflow-postgres onceflow)

metadata=$(cargo metadata --no-deps --format-version 1 --locked)
python3 - "$metadata" "${crates[@]}" <<'PY' || fail "versions are inconsistent"
import json, sys
meta = json.loads(sys.argv[1])
published = set(sys.argv[2:])
pkgs = {p["name"]: p for p in meta["packages"]}
version = pkgs["onceflow"]["version"]
bad = []
for name in sorted(published):
    p = pkgs.get(name)
    if p is None:
        bad.append(f"{name}: not a workspace member")
        continue
    if p["version"] != version:
        bad.append(f"{name} is {p['version']}, the workspace is {version}")
    if p.get("publish") == []:
        bad.append(f"{name} has publish = false")
    for d in p["dependencies"]:
        if d["name"] in published and d["kind"] in (None, "build"):
            if d["req"] not in (f"^{version}", version, f"={version}"):
                bad.append(f"{name} depends on {d['name']} {d['req']}, expected ^{version}")
for p in meta["packages"]:
    if p["name"] not in published and p.get("publish") != []:
        bad.append(f"{p['name']} is neither in the published list nor publish = false")
for b in bad:
    print(b, file=sys.stderr)
sys.exit(1 if bad else 0)
PY

for c in "${crates[@]}"; do
    files=$(cargo package --list --allow-dirty --locked -p "$c" 2>/dev/null) || fail "cargo package --list -p $c"
    for f in Cargo.toml README.md LICENSE; do
        grep -qx "$f" <<<"$files" || fail "$c's package lacks $f"
    done
    grep -qE '^src/lib\.rs$' <<<"$files" || fail "$c's package lacks src/lib.rs"
    stray=$(grep -vE '^(src/.*\.rs|Cargo\.toml|Cargo\.toml\.orig|Cargo\.lock|README\.md|LICENSE|build\.rs|\.cargo_vcs_info\.json)$' <<<"$files" || true)
    [[ -z $stray ]] || fail "$c's package holds files that are not its sources: $stray"
    log "$c: $(wc -l <<<"$files") files, sources + Cargo.toml + README.md + LICENSE"
done

verify=(--no-verify)
[[ ${ONCEFLOW_PACKAGE_VERIFY:-0} == 1 ]] && verify=()
args=()
for c in "${crates[@]}"; do args+=(-p "$c"); done
cargo publish --dry-run --allow-dirty --locked "${verify[@]}" "${args[@]}" >"${TMPDIR:-/tmp}/onceflow-publish-dry-run.log" 2>&1 ||
    { tail -n 40 "${TMPDIR:-/tmp}/onceflow-publish-dry-run.log" >&2; fail "cargo publish --dry-run"; }
log "cargo publish --dry-run ${verify[*]} of ${#crates[@]} crates: OK"
