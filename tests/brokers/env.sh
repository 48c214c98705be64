#!/usr/bin/env bash
# Print the env lines (KEY=VALUE) of the services started by up.sh that still run.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

shopt -s nullglob
for f in "$RUN_DIR"/*.env; do
    n=${f##*/}
    if is_running "${n%.env}"; then
        cat "$f"
    fi
done
