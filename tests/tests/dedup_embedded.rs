//! The dedup-store conformance suite on the embedded (SQLite) store, including a real restart.
onceflow_conformance::dedup_suite!(onceflow_conformance::dedup_suite::EmbeddedHarness::new());
