//! The backend conformance suite on a real Kinesis-compatible server (kinesis-local, started by
//! `tests/brokers/up.sh kinesis`) with the consumer on enhanced fan-out (`fan_out=efo`:
//! RegisterStreamConsumer + SubscribeToShard instead of GetRecords). Same cases and skips as
//! `backend_kinesis.rs`: what a consumer does (groups, commits, starts, seek, nack, pause,
//! lag) must not depend on how shards are fetched. Runs when `ONCEFLOW_KINESIS_URL` is set;
//! with `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) a missing server fails the run.

use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

async fn kinesis_efo() -> PlatformHarness {
    match broker_url("ONCEFLOW_KINESIS_URL", "kinesis") {
        Ok(url) => {
            let sep = if url.contains('?') { '&' } else { '?' };
            let url = format!("{url}{sep}fan_out=efo&lease_ms=3000&idle_ms=100");
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

onceflow_conformance::backend_suite!(kinesis_efo().await);
