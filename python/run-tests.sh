#!/usr/bin/env bash
# The Python package's tests: the wheel built once by maturin (debug profile, the workspace
# target dir), then pytest on python/tests twice, in two cached venvs under ~/.cache/onceflow/:
# one with OpenTelemetry installed, one without (where `send` takes its fast path).
# Broker tests run when ONCEFLOW_KAFKA_URL / ONCEFLOW_NATS_URL are set (tests/run-all.sh sets
# them). Exits non-zero on any failure, and when pytest collected no test at all.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
venv=${ONCEFLOW_PY_VENV:-$HOME/.cache/onceflow/venv-py}
python=${PYTHON:-python3}

log() { printf '[python] %s\n' "$*" >&2; }

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating venv $venv"
    "$python" -m venv "$venv"
fi
log "installing build and test tools into $venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "maturin>=1.5,<2" "pytest>=7" "pytest-asyncio>=0.23" \
    "opentelemetry-api>=1.20" "opentelemetry-sdk>=1.20" "confluent-kafka>=2.3"

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
wheels="$CARGO_TARGET_DIR/python-wheels"
rm -rf "$wheels"
start=$(date +%s)
log "building the wheel (target dir $CARGO_TARGET_DIR)"
"$venv/bin/maturin" build --locked --manifest-path "$here/Cargo.toml" \
    --interpreter "$venv/bin/python" --out "$wheels"
log "wheel built in $(( $(date +%s) - start ))s"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheels"/onceflow-*.whl

# The same wheel in a second venv without OpenTelemetry: there `send` takes its fast path (no
# span, no trace headers), the one most users run, which the first venv never does.
plain=${ONCEFLOW_PY_PLAIN_VENV:-$HOME/.cache/onceflow/venv-py-plain}
if [[ ! -x "$plain/bin/python" ]]; then
    log "creating venv $plain (no OpenTelemetry)"
    "$python" -m venv "$plain"
fi
"$plain/bin/python" -m pip install -q --disable-pip-version-check \
    "pytest>=7" "pytest-asyncio>=0.23" "confluent-kafka>=2.3"
"$plain/bin/python" -m pip uninstall -q -y opentelemetry-api opentelemetry-sdk >/dev/null 2>&1 || true
"$plain/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheels"/onceflow-*.whl

# Run from the tests folder through the pytest script (not `python -m pytest`), so `onceflow`
# is the installed wheel and never the source folder next to it.
cd "$here"
run() {
    local rc
    set +e
    timeout 1800 "$@"
    rc=$?
    set -e
    if [[ $rc -eq 5 ]]; then
        log "pytest collected no tests: failing"
        return 1
    fi
    return "$rc"
}
rc=0
log "pytest with OpenTelemetry installed"
run "$venv/bin/pytest" -q -p no:cacheprovider tests "$@" || rc=$?
log "pytest without OpenTelemetry"
run "$plain/bin/pytest" -q -p no:cacheprovider tests "$@" || rc=$?
exit "$rc"
