//! The checkpoint-store (lease table) conformance suite on the memory store (volatile: no
//! restart cases).
onceflow_conformance::checkpoint_suite!(
    onceflow_conformance::checkpoint_suite::MemoryHarness,
    volatile
);
