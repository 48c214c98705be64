//! The backend conformance suite on a real Kinesis-compatible server (kinesis-local, started by
//! `tests/brokers/up.sh kinesis`). Runs when `ONCEFLOW_KINESIS_URL` is set; without it every case
//! is reported as skipped with that reason, and with `ONCEFLOW_REQUIRE_BROKERS=1` (set by
//! `make test`) a missing server fails the run. Kinesis has no transactions, no atomic batch and
//! no per-message nack: those cases are skipped with the reason (`CAPABILITIES`).

use std::sync::Arc;

use async_trait::async_trait;
use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_core::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, Error, PlatformBackend,
    ProducerBackend, ProducerConfig, Result,
};

const URL_VAR: &str = "ONCEFLOW_KINESIS_URL";

/// Stands in for the platform when no server is configured: every case is skipped before it
/// touches it, and any use fails loudly.
struct NotConnected;

#[async_trait]
impl PlatformBackend for NotConnected {
    fn name(&self) -> &'static str {
        "kinesis"
    }
    fn capabilities(&self) -> Capabilities {
        onceflow_kinesis::CAPABILITIES
    }
    async fn producer(&self, _: ProducerConfig) -> Result<Arc<dyn ProducerBackend>> {
        Err(Error::config(format!("{URL_VAR} is not set")))
    }
    async fn consumer(&self, _: ConsumerConfig) -> Result<Arc<dyn ConsumerBackend>> {
        Err(Error::config(format!("{URL_VAR} is not set")))
    }
    async fn admin(&self) -> Result<Arc<dyn AdminBackend>> {
        Err(Error::config(format!("{URL_VAR} is not set")))
    }
    fn max_record_bytes(&self) -> usize {
        0
    }
}

async fn kinesis() -> PlatformHarness {
    match broker_url(URL_VAR, "kinesis") {
        Ok(url) => {
            let sep = if url.contains('?') { '&' } else { '?' };
            // Short leases and idle pauses keep group handoffs and polling quick on loopback.
            let url = format!("{url}{sep}lease_ms=3000&idle_ms=100");
            let platform = onceflow_kinesis::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("{URL_VAR}='{url}': cannot connect: {e}"));
            PlatformHarness::new(platform, Timings::broker())
        }
        Err(reason) => {
            PlatformHarness::new(Arc::new(NotConnected), Timings::broker()).skip_all(reason)
        }
    }
}

onceflow_conformance::backend_suite!(kinesis().await);
