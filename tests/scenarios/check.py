#!/usr/bin/env python3
"""The cross-language scenario table: every (scenario, language, platform) cell of
tests/scenarios/scenarios.json must have a PASS line in $CARGO_TARGET_DIR/scenarios/<language>.txt,
written by that language's interpreter in this run (tests/run-all.sh removes the folder first).
Prints the table, one row per cell, and exits 1 when a cell failed or is missing: a missing
cell is a failure, never a skip.

Usage: python3 tests/scenarios/check.py [RESULTS_DIR]"""

import json
import os
import pathlib
import sys

LANGUAGES = ["rust", "python", "python-no-otel", "node"]
# Languages that run without a capability a scenario "needs" leave that scenario out.
LACKS = {"python-no-otel": "opentelemetry"}
RUNNERS = {
    "rust": "cargo test -p onceflow-conformance --test scenarios",
    "python": "python/run-tests.sh (tests/test_scenarios.py, in the venv with OpenTelemetry)",
    "python-no-otel": "python/run-tests.sh (tests/test_scenarios.py, in the venv without OpenTelemetry)",
    "node": "node/run-tests.sh (test/scenarios.test.js)",
}


def main() -> int:
    root = pathlib.Path(__file__).resolve().parents[2]
    default = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", root / "target")) / "scenarios"
    results_dir = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default
    spec = json.loads((root / "tests" / "scenarios" / "scenarios.json").read_text())
    names = []
    needs = {}
    for s in spec["scenarios"]:
        for store in s.get("stores", [None]):
            name = s["name"] if store is None else f"{s['name']}[{store}]"
            names.append(name)
            needs[name] = s.get("needs", {})
    platforms = list(spec["platforms"])

    seen = {}
    for lang in LANGUAGES:
        f = results_dir / f"{lang}.txt"
        if not f.exists():
            continue
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5 and parts[0] == "SCENARIO":
                seen[(parts[1], parts[2], parts[3])] = parts[4]

    counts = {lang: {"PASS": 0, "FAIL": 0, "MISSING": 0} for lang in LANGUAGES}
    width = max(len(n) for n in names)
    for name in names:
        for lang in LANGUAGES:
            if LACKS.get(lang) in needs[name]:
                why = needs[name][LACKS[lang]]
                print(f"SCENARIO {name:<{width}} {lang:<14} (all)    not run: needs {LACKS[lang]}: {why}")
                continue
            for p in platforms:
                status = seen.get((name, lang, p), "MISSING")
                counts[lang][status if status in ("PASS", "FAIL") else "MISSING"] += 1
                print(f"SCENARIO {name:<{width}} {lang:<14} {p:<7} {status}")
    bad = False
    for lang in LANGUAGES:
        c = counts[lang]
        print(f"scenarios {lang}: {c['PASS']} passed, {c['FAIL']} failed, {c['MISSING']} missing")
        if c["MISSING"]:
            print(f"  missing cells of {lang}: run by {RUNNERS[lang]}", file=sys.stderr)
        bad = bad or c["FAIL"] > 0 or c["MISSING"] > 0
    unknown = sorted(k for k in seen if k[0] not in names or k[1] not in LANGUAGES or k[2] not in platforms)
    for k in unknown:
        print(f"a result for a cell the spec does not have: {' '.join(k)}", file=sys.stderr)
    return 1 if bad or unknown else 0


if __name__ == "__main__":
    sys.exit(main())
