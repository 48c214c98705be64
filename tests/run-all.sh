#!/usr/bin/env bash
# Every test: starts the brokers the landed adapters need (on loopback, by tests/brokers/up.sh),
# runs the Rust workspace tests against them, and stops only the brokers it started itself.
# Used by `make test` and, through it, by .ci/run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=brokers/lib.sh
source tests/brokers/lib.sh

# Services the landed adapters and stores are tested against.
services=(kafka nats nats-secure pulsar redis redis-secure postgres postgres-secure kinesis)

# How long each phase took, printed at the end (also on failure): where a run's time goes.
phases=()
phase() {
    local name=$1 t0=$SECONDS rc=0
    shift
    "$@" || rc=$?
    phases+=("$name $((SECONDS - t0))s")
    return "$rc"
}

started=()
cleanup() {
    local rc=$?
    ((${#phases[@]})) && log "phase times: ${phases[*]}"
    if ((${#started[@]})); then
        log "stopping what this run started: ${started[*]}"
        tests/brokers/down.sh "${started[@]}" || true
    fi
    exit "$rc"
}
trap cleanup EXIT INT TERM

for s in "${services[@]}"; do
    if ! service_pid "$s" >/dev/null; then
        started+=("$s")
    fi
done
env_lines=$(tests/brokers/up.sh "${services[@]}")
set -a
eval "$env_lines"
set +a
printf '%s\n' "$env_lines" >&2

# Every integration test reads its broker address from these variables; requiring them makes
# a missing broker a failure here instead of a skipped test.
export ONCEFLOW_REQUIRE_BROKERS=1

phases+=("brokers ${SECONDS}s")

# Broker clusters for the fault tests (tests/tests/faults_*.rs, #28): three Kafka brokers and
# three nats-servers, started for the Rust tests only and stopped (by pid) right after them.
clusters=(kafka-cluster nats-cluster)
clusters_started=()
for s in "${clusters[@]}"; do
    if ! service_pid "$s-1" >/dev/null; then
        clusters_started+=("$s")
        started+=("$s")
    fi
done
t0=$SECONDS
cluster_env=$(tests/brokers/up.sh "${clusters[@]}")
phases+=("clusters $((SECONDS - t0))s")
set -a
eval "$cluster_env"
set +a

# The cross-language scenario suite (tests/scenarios/) runs inside the three phases below: its
# Rust test binary with the workspace tests, its Python and Node interpreters with those
# packages' tests, on the wheel and addon they build. Each writes its cells to
# target/scenarios/<language>.txt, cleared here so a cell of an earlier run never counts.
rm -rf "${CARGO_TARGET_DIR:-target}/scenarios"
# Every fault test's `FAULTS <test> injected=N lost=L duplicated=D` line, printed after the
# Rust tests (cargo keeps a passing test's output to itself).
faults_dir=${CARGO_TARGET_DIR:-target}
[[ $faults_dir == /* ]] || faults_dir="$PWD/$faults_dir"
export ONCEFLOW_FAULTS_FILE="$faults_dir/faults.txt"
rm -f "$ONCEFLOW_FAULTS_FILE"
# Two lanes once everything is built: the cluster fault tests (mostly waiting on killed and
# restarted brokers of their own clusters) beside all other test binaries, which run one after
# another as cargo runs them; the others are told not to run the cluster tests again
# (ONCEFLOW_CLUSTER_TESTS=elsewhere). The cluster lane's output follows the main lane's.
cluster_tests=(--test faults_kafka_cluster --test faults_jetstream_cluster)
lanes() {
    if ! cargo test --all-targets --no-run >target/test-build.log 2>&1; then
        tail -n 60 target/test-build.log
        return 1
    fi
    (
        set -o pipefail
        cargo test -p onceflow-conformance "${cluster_tests[@]}" --no-fail-fast \
            >target/test-output-clusters.log 2>&1
    ) &
    local cluster_lane=$! rc=0 cluster_rc=0
    ONCEFLOW_CLUSTER_TESTS=elsewhere cargo test --all-targets --no-fail-fast 2>&1 |
        tee target/test-output.log || rc=$?
    wait "$cluster_lane" || cluster_rc=$?
    log "cluster lane (${cluster_tests[*]}): exit $cluster_rc"
    cat target/test-output-clusters.log
    log "fault tests' figures:"
    cat "$ONCEFLOW_FAULTS_FILE" 2>/dev/null || log "no FAULTS line was written"
    ((rc == 0 && cluster_rc == 0))
}
phase rust lanes
if ((${#clusters_started[@]})); then
    tests/brokers/down.sh "${clusters_started[@]}" || true
fi
phase python bash -c 'set -o pipefail; bash python/run-tests.sh 2>&1 | tee target/python-test-output.log'
phase node bash node/run-tests.sh
# Every (scenario, language, platform) cell passed: a missing one fails like a failed one.
phase scenarios python3 tests/scenarios/check.py

# Installs as users get them (tests/packaging/): the crates as published, a Rust user's crate
# outside the workspace with one platform feature, the wheel and the npm tarball installed
# with no Rust on PATH. Each runs the README's quick start against the brokers above.
packaging=(
    "tests/packaging/cargo-package.sh"
    "tests/packaging/rust-user-crate.sh kafka $ONCEFLOW_KAFKA_URL"
    "tests/packaging/rust-user-crate.sh jetstream $ONCEFLOW_NATS_URL"
    "tests/packaging/python-wheel.sh $ONCEFLOW_KAFKA_URL $ONCEFLOW_NATS_URL"
    "tests/packaging/node-tarball.sh $ONCEFLOW_KAFKA_URL $ONCEFLOW_NATS_URL"
)
passed=0 failed=()
for t in "${packaging[@]}"; do
    # shellcheck disable=SC2086  # each entry is a script and its arguments
    if phase "$(basename "${t%% *}" .sh)" bash $t; then
        passed=$((passed + 1))
    else
        failed+=("$t")
    fi
done
for t in "${failed[@]}"; do log "packaging test failed: $t"; done
echo "packaging: $passed passed, ${#failed[@]} failed"
((${#failed[@]} == 0))
