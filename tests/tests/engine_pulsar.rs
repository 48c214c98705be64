//! The engine conformance suite (idempotent consumer, pipeline) on a real Apache Pulsar
//! standalone, when `ONCEFLOW_PULSAR_URL` is set (`tests/brokers/up.sh pulsar`).

use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

async fn pulsar() -> PlatformHarness {
    match broker_url("ONCEFLOW_PULSAR_URL", "pulsar") {
        Ok(url) => {
            let sep = if url.contains('?') { '&' } else { '?' };
            let url = match std::env::var("ONCEFLOW_PULSAR_ADMIN_URL") {
                Ok(admin) if !url.contains("admin=") => format!("{url}{sep}admin={admin}"),
                _ => url,
            };
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

onceflow_conformance::engine_suite!(pulsar().await);
