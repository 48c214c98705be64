//! The engine conformance suite (idempotent consumer, pipeline) on a real Kinesis-compatible
//! server, when `ONCEFLOW_KINESIS_URL` is set (`tests/brokers/up.sh kinesis`). Without
//! transactions the pipeline runs effectively-once (checkpoint + dedup store).

use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

async fn kinesis() -> PlatformHarness {
    match broker_url("ONCEFLOW_KINESIS_URL", "kinesis") {
        Ok(url) => {
            let sep = if url.contains('?') { '&' } else { '?' };
            let url = format!("{url}{sep}lease_ms=3000&idle_ms=100");
            let platform = onceflow_kinesis::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("ONCEFLOW_KINESIS_URL='{url}': cannot connect: {e}"));
            PlatformHarness::new(platform, Timings::broker())
        }
        // Nothing is contacted: every case is skipped with the reason.
        Err(reason) => PlatformHarness::new(
            MemoryPlatform::isolated(Default::default()),
            Timings::broker(),
        )
        .skip_all(reason),
    }
}

onceflow_conformance::engine_suite!(kinesis().await);
