//! onceflow conformance suites: one for platform backends, one for dedup stores. Each suite is
//! written once against the traits; a backend or store plugs in through a harness and a macro
//! that expands to one `#[tokio::test]` per case.

pub mod backend_suite;
pub mod checkpoint_suite;
pub mod crash;
pub mod dedup_suite;
pub mod engine_suite;
pub mod fault_proxy;
pub mod faults;
pub mod harness;
pub mod http;
pub mod interop;
pub mod kinesis_throttle;
pub mod logs;
