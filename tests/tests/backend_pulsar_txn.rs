//! The backend conformance suite on a real Apache Pulsar standalone with transactions on
//! (`transactions=true`, PIP-31, issue #27): its transaction cases run (commit makes records
//! visible, abort hides them, positions acknowledged in the transaction). A transactional id
//! does not fence an older producer on Pulsar (no producer epochs), and a connected failover
//! member that stops polling keeps its partitions (no session timeout): those two cases are
//! skipped with the reason; the partition check at commit is tested in
//! `adapters/pulsar/tests/transactions.rs`. Runs when
//! `ONCEFLOW_PULSAR_URL` is set (`tests/brokers/up.sh pulsar`).

use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

async fn pulsar() -> PlatformHarness {
    match broker_url("ONCEFLOW_PULSAR_URL", "pulsar") {
        Ok(url) => {
            let sep = if url.contains('?') { '&' } else { '?' };
            let mut url = format!("{url}{sep}transactions=true");
            if let Ok(admin) = std::env::var("ONCEFLOW_PULSAR_ADMIN_URL") {
                if !url.contains("admin=") {
                    url = format!("{url}&admin={admin}");
                }
            }
            let platform = onceflow_pulsar::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("'{url}': cannot connect: {e}"));
            assert!(
                onceflow_core::PlatformBackend::capabilities(&*platform).transactions,
                "transactions=true"
            );
            PlatformHarness::new(platform, Timings::broker())
                .without_read_uncommitted()
                .without_transactional_id_fencing()
                .without_session_timeout_removal()
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
