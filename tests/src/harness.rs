//! How a platform plugs into the backend conformance suite ([`mod@crate::backend_suite`]).
//!
//! A [`Harness`] gives the suite a connected [`PlatformBackend`], names no other test uses, the
//! platform's timings and any setup (topics created through the admin API). [`PlatformHarness`]
//! is the ready-made harness for a platform that needs nothing more than a backend handle.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::{Error, ErrorKind, PlatformBackend, Result, TopicSpec};

/// How long things take on a platform. Cases wait in poll loops until a deadline rather than
/// sleeping, so generous values only slow down failures, never passing runs; only
/// [`quiet`](Timings::quiet) (watching that something does *not* happen) is always spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    /// Longest wait for something expected: a message, an assignment, a rebalance, a topic.
    pub wait: Duration,
    /// How long to watch for something that must not arrive (an aborted record, a paused
    /// partition's message).
    pub quiet: Duration,
    /// Timeout of one `poll` call inside a loop.
    pub poll: Duration,
    /// A short session timeout, for the cases that have a member removed from its group by not
    /// polling (the platform's minimum, e.g. Kafka's `group.min.session.timeout.ms`, 6 s).
    pub session_timeout: Duration,
    /// Upper bound of one case, after which it fails.
    pub case_timeout: Duration,
}

impl Timings {
    /// An in-process backend (`memory://`): everything is immediate.
    pub fn in_process() -> Timings {
        Timings {
            wait: Duration::from_secs(5),
            quiet: Duration::from_millis(150),
            poll: Duration::from_millis(20),
            session_timeout: Duration::from_millis(300),
            case_timeout: Duration::from_secs(30),
        }
    }

    /// A real broker on loopback.
    pub fn broker() -> Timings {
        Timings {
            wait: Duration::from_secs(30),
            quiet: Duration::from_secs(3),
            poll: Duration::from_millis(250),
            session_timeout: Duration::from_secs(6),
            case_timeout: Duration::from_secs(180),
        }
    }
}

/// A random lowercase hex suffix, so names never collide between tests or runs.
pub fn random_suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// What the backend suite needs from a platform.
#[async_trait]
pub trait Harness: Send + Sync {
    /// The connected platform under test.
    fn platform(&self) -> Arc<dyn PlatformBackend>;

    /// How long things take on this platform.
    fn timings(&self) -> Timings {
        Timings::broker()
    }

    /// A name no other test uses: `prefix` and a random suffix, out of `[a-z0-9-]` (legal for
    /// Kafka topics, JetStream streams, Pulsar topics and Kinesis streams).
    fn unique_name(&self, prefix: &str) -> String {
        format!("{prefix}-{}", random_suffix())
    }

    /// A new consumer group name.
    fn group(&self) -> String {
        self.unique_name("suite-group")
    }

    /// A new transactional id.
    fn transactional_id(&self) -> String {
        self.unique_name("suite-tx")
    }

    /// Creates a new topic with `partitions` partitions and returns its name once the platform
    /// describes it. The default creates it through the admin API and waits for it.
    async fn topic(&self, partitions: u32) -> Result<String> {
        let name = self.unique_name("suite-topic");
        let admin = self.platform().admin().await?;
        admin
            .create_topic(&TopicSpec::new(name.clone(), partitions))
            .await?;
        let deadline = tokio::time::Instant::now() + self.timings().wait;
        loop {
            match admin.describe_topic(&name).await {
                Ok(d) if d.partitions == partitions => return Ok(name),
                Ok(_) | Err(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(self.timings().poll).await;
                }
                Ok(d) => {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "topic '{name}' has {} partitions after {:?}, expected {partitions}",
                            d.partitions,
                            self.timings().wait
                        ),
                    ))
                }
                Err(e) => return Err(e.context(format!("topic '{name}' never appeared"))),
            }
        }
    }

    /// Whether read-uncommitted consumers see records of open and aborted transactions here
    /// (Kafka yes; Pulsar has no such isolation level). Only asked where the platform has
    /// transactions.
    fn read_uncommitted(&self) -> bool {
        true
    }

    /// Whether a producer that takes a transactional id fences an older producer with the same
    /// id, so the older one's open transaction cannot commit (Kafka's producer epochs,
    /// KIP-98; Pulsar has no such thing: a member that lost a partition is stopped there by
    /// the partition check at commit and by conflicting acknowledgements). Only asked where
    /// the platform has transactions.
    fn transactional_id_fencing(&self) -> bool {
        true
    }

    /// Whether the group removes a member that stops polling for its session timeout while
    /// still connected (Kafka's session and poll timeouts; Pulsar's failover subscription
    /// moves a partition only when its active consumer disconnects). Only asked where the
    /// platform has transactions.
    fn session_timeout_removal(&self) -> bool {
        true
    }

    /// A reason to skip every case (no broker configured, for example); `None` runs them.
    fn skip_all(&self) -> Option<String> {
        None
    }

    /// Whether a skipped case fails instead (for a backend expected to pass every case).
    fn forbid_skips(&self) -> bool {
        false
    }
}

/// A harness over a platform handle: topics through its admin API, names with a random suffix.
#[derive(Clone)]
pub struct PlatformHarness {
    platform: Arc<dyn PlatformBackend>,
    timings: Timings,
    read_uncommitted: bool,
    transactional_id_fencing: bool,
    session_timeout_removal: bool,
    forbid_skips: bool,
    skip_all: Option<String>,
}

impl PlatformHarness {
    /// A harness for `platform` with `timings`.
    pub fn new(platform: Arc<dyn PlatformBackend>, timings: Timings) -> PlatformHarness {
        PlatformHarness {
            platform,
            timings,
            read_uncommitted: true,
            transactional_id_fencing: true,
            session_timeout_removal: true,
            forbid_skips: false,
            skip_all: None,
        }
    }

    /// Makes any skipped case fail (the backend is expected to pass all of them).
    pub fn forbid_skips(mut self) -> Self {
        self.forbid_skips = true;
        self
    }

    /// Declares that read-uncommitted consumers do not see open or aborted transactional
    /// records on this platform.
    pub fn without_read_uncommitted(mut self) -> Self {
        self.read_uncommitted = false;
        self
    }

    /// Declares that a transactional id does not fence an older producer with the same id
    /// here (see [`Harness::transactional_id_fencing`]).
    pub fn without_transactional_id_fencing(mut self) -> Self {
        self.transactional_id_fencing = false;
        self
    }

    /// Declares that a connected member that stops polling keeps its partitions here (see
    /// [`Harness::session_timeout_removal`]).
    pub fn without_session_timeout_removal(mut self) -> Self {
        self.session_timeout_removal = false;
        self
    }

    /// Skips every case with `reason`.
    pub fn skip_all(mut self, reason: impl Into<String>) -> Self {
        self.skip_all = Some(reason.into());
        self
    }
}

#[async_trait]
impl Harness for PlatformHarness {
    fn platform(&self) -> Arc<dyn PlatformBackend> {
        self.platform.clone()
    }

    fn timings(&self) -> Timings {
        self.timings
    }

    fn read_uncommitted(&self) -> bool {
        self.read_uncommitted
    }

    fn transactional_id_fencing(&self) -> bool {
        self.transactional_id_fencing
    }

    fn session_timeout_removal(&self) -> bool {
        self.session_timeout_removal
    }

    fn skip_all(&self) -> Option<String> {
        self.skip_all.clone()
    }

    fn forbid_skips(&self) -> bool {
        self.forbid_skips
    }
}

/// A harness for the broker whose URL is in the environment variable `var` (set by
/// `tests/brokers/up.sh`). Without it, every case is skipped with that reason — unless
/// `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`), where a missing broker is a failure.
pub fn env_harness(
    var: &str,
    service: &str,
    connect: impl Fn(&str) -> Result<Arc<dyn PlatformBackend>>,
    placeholder_url: &str,
) -> PlatformHarness {
    match broker_url(var, service) {
        Ok(url) => {
            let platform =
                connect(&url).unwrap_or_else(|e| panic!("{var}='{url}' cannot be opened: {e}"));
            PlatformHarness::new(platform, Timings::broker())
        }
        Err(reason) => {
            // Nothing is contacted: no case runs.
            let platform = connect(placeholder_url).expect("placeholder URL");
            PlatformHarness::new(platform, Timings::broker()).skip_all(reason)
        }
    }
}

/// Whether the cluster fault tests (`faults_*_cluster.rs`) run elsewhere in this run:
/// `tests/run-all.sh` runs them in a lane of their own, beside the other test binaries, and
/// sets `ONCEFLOW_CLUSTER_TESTS=elsewhere` for the rest so they do not run twice. Says so
/// for `test` when it does.
pub fn cluster_tests_elsewhere(test: &str) -> bool {
    let elsewhere = std::env::var("ONCEFLOW_CLUSTER_TESTS").as_deref() == Ok("elsewhere");
    if elsewhere {
        eprintln!("{test}: runs in the cluster lane of tests/run-all.sh (ONCEFLOW_CLUSTER_TESTS=elsewhere)");
    }
    elsewhere
}

/// The broker URL in the environment variable `var`, or the reason to skip (naming the
/// `tests/brokers/up.sh` service to start). With `ONCEFLOW_REQUIRE_BROKERS=1` (set by
/// `make test`) a missing URL panics instead: a missing broker fails the run.
pub fn broker_url(var: &str, service: &str) -> std::result::Result<String, String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Ok(url),
        _ => {
            let reason =
                format!("{var} is not set: start the broker with tests/brokers/up.sh {service}");
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but {reason}"
            );
            Err(reason)
        }
    }
}
