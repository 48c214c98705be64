//! The harness of the Pulsar conformance binaries (`backend_pulsar*.rs`, `engine_pulsar*.rs`):
//! `ONCEFLOW_PULSAR_URL` with the admin URL from `ONCEFLOW_PULSAR_ADMIN_URL` and the options
//! given, or every case skipped with the reason (a failure with `ONCEFLOW_REQUIRE_BROKERS=1`).

use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

/// A harness on the test broker with `options` (`key=value&…`, may be empty) added to its URL.
/// Read-uncommitted consumers see no open or aborted transactional records on Pulsar.
pub async fn pulsar(options: &str) -> PlatformHarness {
    match broker_url("ONCEFLOW_PULSAR_URL", "pulsar") {
        Ok(mut url) => {
            fn add(url: &mut String, kv: &str) {
                if !kv.is_empty() {
                    let sep = if url.contains('?') { '&' } else { '?' };
                    *url = format!("{url}{sep}{kv}");
                }
            }
            if !url.contains("admin=") {
                if let Ok(admin) = std::env::var("ONCEFLOW_PULSAR_ADMIN_URL") {
                    add(&mut url, &format!("admin={admin}"));
                }
            }
            add(&mut url, options);
            let platform = onceflow_pulsar::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("'{url}': cannot connect: {e}"));
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
