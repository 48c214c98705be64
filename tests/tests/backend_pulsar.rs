//! The backend conformance suite on a real Apache Pulsar standalone. Runs when
//! `ONCEFLOW_PULSAR_URL` is set (`set -a; eval "$(tests/brokers/up.sh pulsar)"; set +a`);
//! without it every case is reported as skipped with that reason, never passed silently, and
//! with `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`) a missing broker fails the run.
//!
//! Pulsar through the pulsar crate has no transactions and no atomic batches: those cases are
//! skipped with the capability as the reason. The default subscription is failover, whose
//! negative ack rewinds the partition.

use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

/// `ONCEFLOW_PULSAR_URL` with the admin URL from `ONCEFLOW_PULSAR_ADMIN_URL` added.
pub fn pulsar_url(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    match std::env::var("ONCEFLOW_PULSAR_ADMIN_URL") {
        Ok(admin) if !url.contains("admin=") => format!("{url}{sep}admin={admin}"),
        _ => url.to_string(),
    }
}

async fn pulsar() -> PlatformHarness {
    match broker_url("ONCEFLOW_PULSAR_URL", "pulsar") {
        Ok(url) => {
            let url = pulsar_url(&url);
            let platform = onceflow_pulsar::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("ONCEFLOW_PULSAR_URL='{url}': cannot connect: {e}"));
            PlatformHarness::new(platform, Timings::broker()).without_read_uncommitted()
        }
        // Nothing is contacted: every case is skipped with the reason.
        Err(reason) => PlatformHarness::new(
            MemoryPlatform::isolated(Default::default()),
            Timings::broker(),
        )
        .skip_all(reason),
    }
}

onceflow_conformance::backend_suite!(pulsar().await);
