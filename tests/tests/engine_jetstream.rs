//! The engine conformance suite (idempotent consumer, pipeline) on a real nats-server with
//! JetStream, when `ONCEFLOW_NATS_URL` is set (`tests/brokers/up.sh nats`).

use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

async fn jetstream() -> PlatformHarness {
    match broker_url("ONCEFLOW_NATS_URL", "nats") {
        Ok(url) => {
            let sep = if url.contains('?') { '&' } else { '?' };
            // Memory storage and a short ack wait keep crash/redelivery cases fast.
            let url = format!("{url}{sep}storage=memory&ack_wait_ms=2000");
            let platform = onceflow_jetstream::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("ONCEFLOW_NATS_URL='{url}': cannot connect: {e}"));
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

onceflow_conformance::engine_suite!(jetstream().await);
