//! The checkpoint-store (lease table) conformance suite on the embedded (SQLite) store,
//! including a restart and two handles on one file.
onceflow_conformance::checkpoint_suite!(
    onceflow_conformance::checkpoint_suite::EmbeddedHarness::new()
);
