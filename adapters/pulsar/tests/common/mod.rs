//! What the Pulsar adapter's test binaries share: the broker's address from the environment,
//! and names of their own for topics and subscriptions.
#![allow(dead_code)] // each test binary uses a part

/// The value of `var` (set by `tests/brokers/up.sh pulsar`); `None`, said on stderr, when it is
/// not set. With `ONCEFLOW_REQUIRE_BROKERS=1` its absence fails the test instead.
pub fn require(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but {var} is not set (tests/brokers/up.sh pulsar)"
            );
            eprintln!(
                "{}: SKIPPED: {var} is not set (start a broker with tests/brokers/up.sh pulsar)",
                env!("CARGO_CRATE_NAME")
            );
            None
        }
    }
}

/// `prefix` followed by 12 random hex digits: a topic or subscription name no other run uses.
pub fn name(prefix: &str) -> String {
    format!("{prefix}-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}
