//! The backend conformance suite on a real Apache Kafka broker. Runs when `ONCEFLOW_KAFKA_URL`
//! is set (`set -a; eval "$(tests/brokers/up.sh kafka)"; set +a`); without it every case is
//! reported as skipped with that reason, never passed silently, and with
//! `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`) a missing broker is a failure.

use onceflow_conformance::harness::{env_harness, PlatformHarness};

fn kafka() -> PlatformHarness {
    env_harness(
        "ONCEFLOW_KAFKA_URL",
        "kafka",
        |url| Ok(onceflow_kafka::connect(url)?),
        "kafka://127.0.0.1:9",
    )
}

onceflow_conformance::backend_suite!(kafka());
