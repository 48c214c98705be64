//! What the Redis integration tests share.

/// The server's URL; without one the calling test `what` skips, unless
/// `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) makes a missing server a failure.
pub fn base(what: &str) -> Option<String> {
    let url = std::env::var("ONCEFLOW_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty());
    if url.is_none() {
        assert!(
            std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
            "ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_REDIS_URL is not set (tests/brokers/up.sh redis)"
        );
        eprintln!("{what}: SKIPPED: ONCEFLOW_REDIS_URL is not set");
    }
    url
}
