#!/usr/bin/env bash
# Stop services started by up.sh, by the pid in $RUN_DIR/NAME.pid (SIGTERM to the
# process group, SIGKILL after 20 s). No names = every service with a pid file.
# A cluster (nats-cluster, kafka-cluster) is stopped by its name: its nodes NAME-1, NAME-2, …
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
    shopt -s nullglob
    nodes=("$RUN_DIR/$name"-[0-9]*.pid)
    shopt -u nullglob
    if [[ ! -e $RUN_DIR/$name.pid ]] && ((${#nodes[@]})); then
        for f in "${nodes[@]}"; do
            n=${f##*/}
            stop_service "${n%.pid}"
        done
        rm -f "$RUN_DIR/$name.env"
    else
        stop_service "$name"
    fi
done
