//! What the PostgreSQL store's integration tests share.

/// The server's URL (`ONCEFLOW_POSTGRES_URL`, from `tests/brokers/up.sh postgres`); without
/// one the server cases of test `what` skip, unless `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`)
/// makes a missing server a failure.
pub fn base(what: &str) -> Option<String> {
    let url = std::env::var("ONCEFLOW_POSTGRES_URL")
        .ok()
        .filter(|u| !u.is_empty());
    if url.is_none() {
        assert!(
            std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
            "ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_POSTGRES_URL is not set \
             (tests/brokers/up.sh postgres)"
        );
        eprintln!("{what}: SKIPPED: ONCEFLOW_POSTGRES_URL is not set");
    }
    url
}
