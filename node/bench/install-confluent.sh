#!/usr/bin/env bash
# Installs @confluentinc/kafka-javascript for JS1 (bench/js1.js) into its own folder, outside
# this package's dependencies: ${ONCEFLOW_BENCH_CONFLUENT_DIR:-~/.cache/onceflow/confluent-kafka-javascript}.
#
# Its install step first downloads a prebuilt addon from GitHub releases and, when that fails,
# compiles it with node-gyp. The default (static) compile of its bundled librdkafka downloads
# zlib, OpenSSL, zstd and curl sources from their sites, which only the npm registry being
# reachable rules out; CKJS_LINKING=dynamic configures the bundled librdkafka against the system
# libraries instead (features whose library is missing are left out; JS1 needs none of them).
# npm_config_nodedir points node-gyp at the installed Node headers instead of downloading them.
# The compile runs `make -j` without a bound: it is niced. Takes several minutes.
set -euo pipefail
version=${ONCEFLOW_BENCH_CONFLUENT_VERSION:-1.10.1}
dir=${ONCEFLOW_BENCH_CONFLUENT_DIR:-$HOME/.cache/onceflow/confluent-kafka-javascript}
mkdir -p "$dir"
cd "$dir"
[[ -f package.json ]] || npm init -y >/dev/null
nodedir=$(dirname "$(dirname "$(readlink -f "$(command -v node)")")")
export npm_config_cache=${ONCEFLOW_NPM_CACHE:-$HOME/.cache/onceflow/npm}
export npm_config_nodedir=${npm_config_nodedir:-$nodedir}
export CKJS_LINKING=${CKJS_LINKING:-dynamic}
nice -n 15 npm install --no-audit --no-fund --foreground-scripts "@confluentinc/kafka-javascript@$version"
node -e "const k = require('@confluentinc/kafka-javascript'); console.log('installed @confluentinc/kafka-javascript with librdkafka', k.librdkafkaVersion)"
