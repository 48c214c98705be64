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
