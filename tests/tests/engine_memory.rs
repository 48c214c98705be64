//! The engine conformance suite (idempotent consumer, pipeline) on `memory://`; no case may be
//! skipped.

use onceflow_conformance::harness::{random_suffix, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

fn memory() -> PlatformHarness {
    let name = format!("engine-{}", random_suffix());
    let platform = onceflow_memory::connect(&format!("memory://{name}")).expect("memory:// URL");
    MemoryPlatform::forget(&name);
    PlatformHarness::new(platform, Timings::in_process()).forbid_skips()
}

onceflow_conformance::engine_suite!(memory());
