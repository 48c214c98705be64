#!/usr/bin/env bash
# Start brokers on loopback for the tests; prints only KEY=VALUE lines on stdout:
#   set -a; eval "$(tests/brokers/up.sh kafka nats)"; set +a
# Names: kafka nats redis postgres pulsar kinesis (none = kafka nats redis postgres).
# Idempotent: a service that already runs and answers just re-prints its env.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

names=("$@")
((${#names[@]})) || names=(kafka nats redis postgres)

for name in "${names[@]}"; do
    script="$BROKERS_DIR/$name/up.sh"
    [[ $name =~ ^[a-z0-9_-]+$ && -f $script ]] || { log "unknown service: $name"; exit 2; }
done

for name in "${names[@]}"; do
    # One up.sh per service at a time (parallel callers wait for each other).
    exec {lock}>"$RUN_DIR/$name.lock"
    flock "$lock"
    if ! bash "$BROKERS_DIR/$name/up.sh" {lock}>&-; then
        log "$name failed to start"
        exit 1
    fi
    exec {lock}>&-
done
