//! The engine conformance suite on a real Apache Pulsar standalone with transactions on
//! (`transactions=true`, PIP-31, issue #27): the pipeline writes its outputs and acknowledges
//! its inputs in Pulsar transactions and reports `exactly-once`; the idempotent consumer runs
//! as without. Runs when `ONCEFLOW_PULSAR_URL` is set (`tests/brokers/up.sh pulsar`).

mod pulsar_harness;

onceflow_conformance::engine_suite!(pulsar_harness::pulsar("transactions=true").await);
