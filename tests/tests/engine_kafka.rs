//! The engine conformance suite (idempotent consumer, pipeline) on a real Apache Kafka broker,
//! when `ONCEFLOW_KAFKA_URL` is set (`tests/brokers/up.sh kafka`).

use onceflow_conformance::harness::{env_harness, PlatformHarness};

fn kafka() -> PlatformHarness {
    env_harness(
        "ONCEFLOW_KAFKA_URL",
        "kafka",
        |url| Ok(onceflow_kafka::connect(url)?),
        "kafka://127.0.0.1:9",
    )
}

onceflow_conformance::engine_suite!(kafka());
