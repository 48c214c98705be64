#!/usr/bin/env bash
# Restarts redis with the data it has (stop as down.sh does, start as up.sh does, same data
# directory): the store-restart tests use it. Prints the env lines like up.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
is_running redis || die "redis is not running (start it with tests/brokers/up.sh redis)"
stop_service redis
ONCEFLOW_KEEP_DATA=1 bash "$BROKERS_DIR/redis/up.sh"
