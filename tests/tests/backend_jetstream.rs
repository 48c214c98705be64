//! The backend conformance suite on a real nats-server with JetStream. Runs when
//! `ONCEFLOW_NATS_URL` is set (`set -a; eval "$(tests/brokers/up.sh nats)"; set +a`); without it
//! every case is reported as skipped with that reason, never passed silently, and with
//! `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`) a missing server fails the run.
//!
//! Streams are created with `storage=memory` so cases do not wait on disk; every case makes its
//! own streams and groups with random names.

use std::sync::Arc;

use async_trait::async_trait;
use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_core::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, Error, PlatformBackend,
    ProducerBackend, ProducerConfig, Result,
};

const URL_VAR: &str = "ONCEFLOW_NATS_URL";

/// Stands in for the platform when no server is configured: every case is skipped before it
/// touches it, and any use fails loudly.
struct NotConnected;

#[async_trait]
impl PlatformBackend for NotConnected {
    fn name(&self) -> &'static str {
        "jetstream"
    }
    fn capabilities(&self) -> Capabilities {
        onceflow_jetstream::CAPABILITIES
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

async fn jetstream() -> PlatformHarness {
    match broker_url(URL_VAR, "nats") {
        Ok(url) => {
            let sep = if url.contains('?') { '&' } else { '?' };
            let url = format!("{url}{sep}storage=memory");
            let platform = onceflow_jetstream::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("{URL_VAR}='{url}': cannot connect: {e}"));
            PlatformHarness::new(platform, Timings::broker())
        }
        // Without a server (and without ONCEFLOW_REQUIRE_BROKERS=1, which panics instead) every
        // case is skipped with the reason.
        Err(reason) => {
            PlatformHarness::new(Arc::new(NotConnected), Timings::broker()).skip_all(reason)
        }
    }
}

onceflow_conformance::backend_suite!(jetstream().await);
