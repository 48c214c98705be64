#!/usr/bin/env bash
# Restarts postgres with the data it has (stop as down.sh does, start as up.sh does, same data
# directory): the store-restart tests use it. Prints the env lines like up.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
is_running postgres || die "postgres is not running (start it with tests/brokers/up.sh postgres)"
stop_service postgres
ONCEFLOW_KEEP_DATA=1 bash "$BROKERS_DIR/postgres/up.sh"
