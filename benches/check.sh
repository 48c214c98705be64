#!/usr/bin/env bash
# The guard against the next benchmark regression (`make bench-check`): runs the headline
# benchmarks in their short form and prints each figure next to the last recorded one
# (benches/recorded.tsv, the figures benches/RESULTS.md gives with the commit they were measured
# on), flagging every figure that got more than 20 % worse (fell, or rose for an upper-bound target
# such as M0's nanoseconds). Exits 1 when one did.
#
#   benches/check.sh [ID...]      IDs among k1 k3 k4 m0 (default: k1 k3 k4 m0)
#
# Short forms: K1 3 rounds, K3 5 rounds, K4 its default 1M inputs (shorter runs are decided by
# the group join, see RESULTS.md), M0 as it is. Figures compared are the RATIO lines (both sides
# measured in the same run, so a slower machine moves them less than absolute rates); INFO
# lines are printed, not judged. The Kafka broker comes from tests/brokers/up.sh (started here
# when it is not running, and stopped again afterwards).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=../tests/brokers/lib.sh
source tests/brokers/lib.sh
log() { printf "[bench-check] %s\n" "$*" >&2; }
ids=("$@")
((${#ids[@]})) || ids=(k1 k3 k4 m0)
recorded=benches/recorded.tsv

started=
if [[ " ${ids[*]} " == *" k"* ]] && ! service_pid kafka >/dev/null; then
    started=kafka
fi
cleanup() { [[ -n $started ]] && tests/brokers/down.sh kafka || true; }
trap cleanup EXIT
if [[ " ${ids[*]} " == *" k"* ]]; then
    eval "$(tests/brokers/up.sh kafka)"
    export ONCEFLOW_KAFKA_URL
fi

export ONCEFLOW_K1_ROUNDS=${ONCEFLOW_K1_ROUNDS:-3} ONCEFLOW_K3_ROUNDS=${ONCEFLOW_K3_ROUNDS:-5}
out=$(mktemp)
trap 'rm -f "$out"; cleanup' EXIT
log "running ${ids[*]} on $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes') (load $(cut -d' ' -f1-3 /proc/loadavg))"
cargo run --release --locked -q -p onceflow-bench -- "${ids[@]}" | tee "$out"

python3 - "$out" "$recorded" <<'PY'
import sys
run, recorded = sys.argv[1], sys.argv[2]
last = {}
for line in open(recorded):
    if line.startswith("#") or not line.strip():
        continue
    bench, what, value, commit, date = line.rstrip("\n").split("\t")[:5]
    last[(bench, what)] = (float(value), commit, date)
fell = 0
print(f"\n{'figure':<58} {'now':>8} {'recorded':>9}  change  (recorded at)")
for line in open(run):
    parts = line.split()
    if len(parts) < 4 or parts[0] != "RATIO" or parts[-1] == "INFO" or parts[3] == "n/a":
        continue
    bench, what, value = parts[1], parts[2], float(parts[3])
    # A figure whose target is an upper bound ("target <=300", M0's nanoseconds) regresses
    # when it rises; every other one when it falls.
    lower_is_better = len(parts) > 5 and parts[5].startswith("<=")
    name = f"{bench} {what}"
    if (bench, what) not in last:
        print(f"{name:<58} {value:>8.3f} {'-':>9}  (none recorded)")
        continue
    old, commit, date = last[(bench, what)]
    change = (value - old) / old * 100
    worse = change > 20 if lower_is_better else change < -20
    flag = ("  ROSE >20%" if lower_is_better else "  FELL >20%") if worse else ""
    fell += bool(flag)
    print(f"{name:<58} {value:>8.3f} {old:>9.3f}  {change:+5.0f}%  ({commit}, {date}){flag}")
print(f"\nbench-check: {fell} figure(s) more than 20 % worse than recorded" if fell else "\nbench-check: no figure more than 20 % worse than recorded")
sys.exit(1 if fell else 0)
PY
