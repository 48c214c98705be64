# shellcheck shell=bash
# Helpers shared by the packaging tests under tests/packaging/ (sourced, not run).

PACKAGING_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# readme_block SECTION LANG: the first ```LANG fenced block under the README.md heading
# "## SECTION", as the README has it.
readme_block() {
    awk -v section="## $1" -v lang="$2" '
        /^## / { in_section = ($0 == section) }
        in_section && !done && $0 ~ "^```" lang "([ ,].*)?$" { grab = 1; next }
        grab && /^```/ { grab = 0; done = 1; next }
        grab { print }
    ' "$PACKAGING_ROOT/README.md"
}

# path_without_rust: $PATH without the directories that hold cargo, rustc or rustup, so what
# runs under it shows that no Rust toolchain is needed. Fails if one is still found.
path_without_rust() {
    local dir kept=()
    IFS=: read -ra dirs <<<"$PATH"
    for dir in "${dirs[@]}"; do
        [[ -x $dir/cargo || -x $dir/rustc || -x $dir/rustup ]] && continue
        kept+=("$dir")
    done
    local p
    p=$(IFS=:; echo "${kept[*]}")
    if PATH=$p command -v cargo >/dev/null || PATH=$p command -v rustc >/dev/null; then
        echo "cargo or rustc is still on the reduced PATH $p" >&2
        return 1
    fi
    echo "$p"
}

# expect_once FILE TEXT: TEXT occurs on exactly one line of FILE.
expect_once() {
    local n
    n=$(grep -cF -- "$2" "$1" || true)
    [[ $n == 1 ]] || { echo "expected '$2' once, found it $n times in:" >&2; cat "$1" >&2; return 1; }
}

# packaging_test NAME: the common start of a packaging test. Defines `log` and `fail` (prefixed
# with NAME), sets `root` (the checkout), `dir` (a temp dir removed on exit) and
# CARGO_TARGET_DIR (the checkout's target dir unless set), and `bare_path` (PATH without Rust).
packaging_test() {
    PACKAGING_NAME=$1
    log() { printf '[%s] %s\n' "$PACKAGING_NAME" "$*" >&2; }
    fail() { log "FAILED: $*"; exit 1; }
    root=$PACKAGING_ROOT
    dir=$(mktemp -d "${TMPDIR:-/tmp}/onceflow-${1// /-}.XXXXXX")
    # shellcheck disable=SC2064  # $dir is fixed now
    trap "rm -rf '$dir'" EXIT
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
    bare_path=$(path_without_rust) || fail "cannot hide the Rust toolchain"
}
