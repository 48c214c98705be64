#!/usr/bin/env bash
# Stop services started by up.sh, by the pid in $RUN_DIR/NAME.pid (SIGTERM to the
# process group, SIGKILL after 20 s). No names = every service with a pid file.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

names=("$@")
if ((${#names[@]} == 0)); then
    shopt -s nullglob
    for f in "$RUN_DIR"/*.pid; do
        n=${f##*/}
        names+=("${n%.pid}")
    done
fi

for name in "${names[@]}"; do
    [[ $name =~ ^[a-z0-9_-]+$ ]] || { log "bad service name: $name"; exit 2; }
    stop_service "$name"
done
