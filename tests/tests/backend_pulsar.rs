//! The backend conformance suite on a real Apache Pulsar standalone. Runs when
//! `ONCEFLOW_PULSAR_URL` is set (`set -a; eval "$(tests/brokers/up.sh pulsar)"; set +a`);
//! without it every case is reported as skipped with that reason, never passed silently, and
//! with `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`) a missing broker fails the run.
//!
//! Pulsar through the pulsar crate has no transactions and no atomic batches: those cases are
//! skipped with the capability as the reason. The default subscription is failover, whose
//! negative ack rewinds the partition.

mod pulsar_harness;

onceflow_conformance::backend_suite!(pulsar_harness::pulsar("").await);
