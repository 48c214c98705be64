//! The backend conformance suite on `memory://`: a broker of its own per case, and no case may
//! be skipped (the memory backend has every capability the suite tests).

use onceflow_conformance::harness::{random_suffix, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

fn memory() -> PlatformHarness {
    let name = format!("suite-{}", random_suffix());
    let platform = onceflow_memory::connect(&format!("memory://{name}")).expect("memory:// URL");
    // The handle keeps the broker alive; nothing else needs to find it by name.
    MemoryPlatform::forget(&name);
    PlatformHarness::new(platform, Timings::in_process()).forbid_skips()
}

onceflow_conformance::backend_suite!(memory());
