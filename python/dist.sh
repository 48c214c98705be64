#!/usr/bin/env bash
# Builds the wheel users install with `pip install onceflow`: one abi3 wheel (CPython >= 3.10)
# with every backend and store compiled in, its native library stripped, tagged manylinux for
# the glibc it links against (maturin checks the tag as auditwheel would). No Rust is needed to
# install it.
#
#   python/dist.sh [--profile release|dev] [--out DIR]     (default: release, dist/python)
#
# Prints the wheel's path on stdout and its size on stderr. `make dist` runs it; the packaging
# test (tests/packaging/python-wheel.sh) runs it with `--profile dev` to reuse the test build.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
DIST_NAME=python/dist.sh DIST_DEFAULT_OUT=$root/dist/python
# shellcheck source=../tools/dist-args.sh
source "$root/tools/dist-args.sh"
flags=()
[[ $profile == release ]] && flags=(--release)
log() { printf '[python dist] %s\n' "$*" >&2; }

venv=${ONCEFLOW_PY_VENV:-$HOME/.cache/onceflow/venv-py}
if [[ ! -x "$venv/bin/maturin" ]]; then
    [[ -x "$venv/bin/python" ]] || "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2"
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
rm -rf "$out"
mkdir -p "$out"
log "building the $profile wheel (target dir $CARGO_TARGET_DIR)"
"$venv/bin/maturin" build --locked "${flags[@]}" --strip --manifest-path "$here/Cargo.toml" \
    --interpreter "$venv/bin/python" --out "$out" >&2
wheel=$(ls "$out"/onceflow-*.whl)
[[ $(wc -l <<<"$wheel") == 1 ]] || { log "expected one wheel in $out, found: $wheel"; exit 1; }
case $wheel in
*-abi3-manylinux*) ;;
*) log "the wheel is not an abi3 manylinux wheel: $(basename "$wheel")"; exit 1 ;;
esac
log "$(basename "$wheel"): $(du -h "$wheel" | cut -f1) ($(stat -c %s "$wheel") bytes)"
echo "$wheel"
