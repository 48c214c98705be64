//! The engine conformance suite (idempotent consumer, pipeline) on a real Apache Pulsar
//! standalone, when `ONCEFLOW_PULSAR_URL` is set (`tests/brokers/up.sh pulsar`).

mod pulsar_harness;

onceflow_conformance::engine_suite!(pulsar_harness::pulsar("").await);
