//! The engine conformance suite on Pulsar with transactions on and batching producers
//! (`batch_size=50&batch_timeout_ms=20` on the URL: the pipeline's outputs leave in batches,
//! issue #27's late-SEND fix, helper h1). Runs when `ONCEFLOW_PULSAR_URL` is set.

mod pulsar_harness;

onceflow_conformance::engine_suite!(
    pulsar_harness::pulsar("transactions=true&batch_size=50&batch_timeout_ms=20").await
);
