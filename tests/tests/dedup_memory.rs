//! The dedup-store conformance suite on the memory store (volatile: no restart cases).
onceflow_conformance::dedup_suite!(onceflow_conformance::dedup_suite::MemoryHarness, volatile);
