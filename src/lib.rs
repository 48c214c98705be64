//! # onceflow
//!
//! One API for an **idempotent consumer** and a **transactional producer** on Apache Kafka,
//! AWS Kinesis, Apache Pulsar and NATS JetStream. A URL picks the platform, so the same program
//! moves between platforms by configuration alone; every producer and pipeline reports the
//! [`Guarantee`] it actually runs with.
//!
//! ```no_run
//! # async fn demo() -> onceflow::Result<()> {
//! use onceflow::{ConsumerConfig, IdempotentConsumer, ProducerConfig, Record, handler_fn};
//!
//! let client = onceflow::connect("memory://quickstart").await?;
//! let producer = client.producer(ProducerConfig::new()).await?;
//! producer
//!     .send(Record::new("orders", "order #1").key("customer-7").idempotency_key("order-1"))
//!     .await?;
//!
//! let consumer = client.consumer(ConsumerConfig::new("billing", ["orders"])).await?;
//! let store = onceflow::dedup_store("memory://", std::time::Duration::from_secs(3600)).await?;
//! let billing = IdempotentConsumer::new(consumer, Some(store), handler_fn(|m| async move {
//!     println!("charging for {:?}", m.payload);
//!     Ok(None)
//! }));
//! billing.run_until(tokio::time::sleep(std::time::Duration::from_secs(1))).await?;
//! # Ok(()) }
//! ```
//!
//! ## Crate features
//! - `memory` (default): the in-process `memory://` backend, with full semantics, for tests and
//!   the demo.
//!
//! - `redis` (default): the Redis dedup store, `redis://` URLs in [`dedup_store`]; the crate is
//!   re-exported as `onceflow::redis`.
//! - `postgres` (default): the PostgreSQL dedup store, `postgres://` URLs in [`dedup_store`],
//!   and the transactional inbox; the crate is re-exported as `onceflow::postgres`.
//!
//! Platform adapters (`kafka`, `jetstream`, `pulsar`, `kinesis`) are added as features of this
//! crate as they land.

use std::sync::Arc;
use std::time::Duration;

pub use onceflow_core::*;

#[cfg(feature = "memory")]
pub use onceflow_memory as memory;
#[cfg(feature = "postgres")]
pub use onceflow_postgres as postgres;
#[cfg(feature = "redis")]
pub use onceflow_redis as redis;

/// The platforms compiled into this build: each adapter crate's registry entry
/// ([`registry::PlatformEntry`]). A new platform is one line here.
pub const PLATFORMS: &[&registry::PlatformEntry] = &[
    #[cfg(feature = "memory")]
    &onceflow_memory::PLATFORM,
    #[cfg(feature = "kafka")]
    &onceflow_kafka::PLATFORM,
    #[cfg(feature = "jetstream")]
    &onceflow_jetstream::PLATFORM,
    #[cfg(feature = "pulsar")]
    &onceflow_pulsar::PLATFORM,
    #[cfg(feature = "kinesis")]
    &onceflow_kinesis::PLATFORM,
];

/// The shared dedup / checkpoint stores compiled into this build (`memory://` and the
/// embedded store are core's and always there).
pub const STORES: &[&registry::StoreEntry] = &[
    #[cfg(feature = "redis")]
    &onceflow_redis::STORE,
    #[cfg(feature = "postgres")]
    &onceflow_postgres::STORE,
];

/// Every platform scheme onceflow has an adapter for, compiled into this build or not (for the
/// error that names a scheme this build lacks): `tls://` is NATS over TLS, `pulsar+ssl://`
/// Pulsar over TLS.
const KNOWN_SCHEMES: [&str; 7] = [
    "memory",
    "kafka",
    "nats",
    "tls",
    "pulsar",
    "pulsar+ssl",
    "kinesis",
];

/// Every shared store scheme onceflow has a crate for, compiled into this build or not, with
/// that crate and the facade's cargo feature (for the error that names a store this build
/// lacks; in a build with it, [`STORES`] opens it).
const KNOWN_STORE_SCHEMES: [(&str, &str, &str); 4] = [
    ("redis", "onceflow-redis", "redis"),
    ("rediss", "onceflow-redis", "redis"),
    ("postgres", "onceflow-postgres", "postgres"),
    ("postgresql", "onceflow-postgres", "postgres"),
];

/// The error for a `what` (`dedup`, `checkpoint`) store URL of a store crate this build lacks
/// (see [`KNOWN_STORE_SCHEMES`]): [`ErrorKind::Unsupported`], or [`ErrorKind::Config`] for its
/// bare scheme name (a forgotten `://`, not a file to create). `None` for any other URL.
fn absent_store(url: &str, what: &str) -> Option<Error> {
    let trimmed = url.trim();
    let (scheme, bare) = match trimmed.split_once("://") {
        Some((s, _)) => (s.to_ascii_lowercase(), false),
        None => (trimmed.trim_end_matches(':').to_ascii_lowercase(), true),
    };
    if registry::store_for(STORES, &scheme).is_some() {
        return None;
    }
    let (scheme, krate, feature) = KNOWN_STORE_SCHEMES.iter().find(|(s, ..)| *s == scheme)?;
    if bare {
        return Some(Error::config(format!(
            "{what} store '{}' looks like a URL scheme without '://' (did you mean \
             '{scheme}://'?); to use a file of that name, write ./{trimmed}",
            onceflow_core::shown(&redact_credentials(url))
        )));
    }
    Some(Error::unsupported(format!(
        "{what} store URL scheme '{scheme}://' ('{}') is provided by the {krate} crate, not \
         compiled into this build of onceflow: enable the facade's `{feature}` feature; \
         supported here: {}",
        onceflow_core::shown(&redact_credentials(url)),
        supported_stores().join(", ")
    )))
}

/// URL schemes this build can open, for error messages (`kafka://`, …, from [`PLATFORMS`]).
pub fn supported_schemes() -> Vec<&'static str> {
    PLATFORMS
        .iter()
        .flat_map(|p| p.schemes.iter().copied())
        .collect()
}

/// Dedup and checkpoint store kinds this build can open with [`dedup_store`], for
/// `onceflow --version` and error messages: `memory://` and `embedded` (a file path or
/// `embedded:///path`) always, then the first scheme of each entry of [`STORES`]
/// (`redis://`, `postgres://`).
pub fn supported_stores() -> Vec<&'static str> {
    let mut v = vec!["memory://", "embedded"];
    v.extend(STORES.iter().filter_map(|e| e.schemes.first().copied()));
    v
}

/// What a platform's connect may open through the rest of the build.
fn openers() -> registry::Openers {
    registry::Openers {
        checkpoint_store: |url| registry::boxed(async move { checkpoint_store(&url).await }),
    }
}

/// The version line `onceflow --version` prints: the crate version, then the platforms and
/// stores compiled into this build, e.g.
/// `0.1.0 (platforms: memory:// kafka:// nats:// pulsar:// kinesis://; stores: memory:// embedded redis:// postgres://)`.
pub fn version_line() -> String {
    format!(
        "{} (platforms: {}; stores: {})",
        env!("CARGO_PKG_VERSION"),
        supported_schemes().join(" "),
        supported_stores().join(" ")
    )
}

/// Connects to the platform named by `url`'s scheme: `memory://NAME` (feature `memory`).
///
/// Errors: [`ErrorKind::Config`] for a malformed URL or an unknown scheme (the message names the
/// scheme and lists the supported ones); [`ErrorKind::Unsupported`] for a known platform whose
/// feature is not compiled in; [`ErrorKind::Connect`] when the platform cannot be reached.
/// For `kafka://` (`onceflow_kafka::open`) and `pulsar://` a broker must answer now: a wrong
/// address or a stopped broker fails within seconds, naming each address tried, instead of on
/// the first call after the native client's own timeouts.
pub async fn connect(url: &str) -> Result<Client> {
    let scheme = url.split_once("://").map(|(s, _)| s).ok_or_else(|| {
        Error::config(format!(
            "'{}' is not a platform URL: expected SCHEME://..., one of {}",
            onceflow_core::shown(&redact_credentials(url)),
            supported_schemes().join(", ")
        ))
    })?;
    if let Some(entry) = registry::platform_for(PLATFORMS, scheme) {
        return (entry.connect)(url.to_string(), openers()).await;
    }
    if KNOWN_SCHEMES.contains(&scheme.to_ascii_lowercase().as_str()) {
        return Err(Error::unsupported(format!(
            "'{scheme}://' is not compiled into this build of onceflow (enable its cargo feature); supported here: {}",
            supported_schemes().join(", ")
        )));
    }
    Err(Error::config(format!(
        "unknown platform scheme '{}://' in '{}': expected one of {}",
        onceflow_core::shown(scheme),
        onceflow_core::shown(&redact_credentials(url)),
        supported_schemes().join(", ")
    )))
}

/// `url` with `options` added to its query as `KEY=VALUE` parameters (form-encoded, so PEM
/// text, `&`, `=` and spaces pass), after the ones it already has: what the Python and Node
/// bindings and the CLI do with an options dict / object / `--option KEY=VALUE`. Every adapter
/// reads its settings from the query (for `kafka://`, librdkafka properties such as
/// `security.protocol`, `sasl.password`, `ssl.ca.location`), so a secret can stay out of the URL
/// string a program logs or prints.
///
/// Errors: [`ErrorKind::Config`] for an option with an empty key, or a URL with a `#fragment`
/// (where the options would not be query parameters), naming the key or the URL without its
/// credentials.
pub fn url_with_options<'a>(
    url: &str,
    options: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<String> {
    let mut query = url::form_urlencoded::Serializer::new(String::new());
    let mut any = false;
    for (k, v) in options {
        if k.trim().is_empty() {
            return Err(Error::config(format!(
                "invalid option for '{}': an empty name, expected NAME=VALUE",
                onceflow_core::shown(&redact_credentials(url))
            )));
        }
        query.append_pair(k, v);
        any = true;
    }
    if !any {
        return Ok(url.to_string());
    }
    if url.contains('#') {
        return Err(Error::config(format!(
            "URL '{}' has a #fragment: options cannot be added to its query; give them in the \
             URL before the '#' instead",
            onceflow_core::shown(&redact_credentials(url))
        )));
    }
    let sep = match url.find('?') {
        None => "?",
        Some(_) if url.ends_with('?') || url.ends_with('&') => "",
        Some(_) => "&",
    };
    Ok(format!("{url}{sep}{}", query.finish()))
}

/// [`connect`] with `options` added to the URL's query ([`url_with_options`]): a later option
/// of the same name as a query parameter wins where the adapter keeps the last value (every
/// adapter does).
///
/// Errors: those of [`url_with_options`] and [`connect`].
pub async fn connect_with<'a>(
    url: &str,
    options: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<Client> {
    connect(&url_with_options(url, options)?).await
}

/// Opens a dedup store by URL: `memory://` (bounded, in-process), `embedded:///path/to/file.db`
/// or a plain file path (on disk, survives restarts), `redis://…` (feature `redis`, see
/// `onceflow_redis::RedisStore`) or `postgres://…` / `postgresql://…` (feature `postgres`, see
/// `onceflow_postgres::PostgresStore`), shared by every consumer that opens the same URL.
/// Completed keys are remembered for `window`.
///
/// Errors: [`ErrorKind::Config`] for an unknown scheme, a zero window or a file path that is a
/// directory, a device or in a directory that does not exist, [`ErrorKind::Unsupported`] for
/// `redis://` / `postgres://` in a build without that feature, [`ErrorKind::DedupStore`] for a
/// path or server that cannot be used otherwise (naming it, without its password).
pub async fn dedup_store(url: &str, window: Duration) -> Result<Arc<dyn DedupStore>> {
    // (A zero window is core's error first, whatever the scheme.)
    if let Some(e) = absent_store(url, "dedup").filter(|_| !window.is_zero()) {
        return Err(e);
    }
    onceflow_core::dedup::open_with(url, window, STORES).await
}

/// Opens a checkpoint store (the lease table of self-coordinating consumer groups, see
/// [`checkpoint::CheckpointStore`]) by URL: `memory://`, `embedded:///path/to/file.db` or a
/// plain file path, `redis://…` (feature `redis`, `onceflow_redis::RedisCheckpointStore`) or
/// `postgres://…` / `postgresql://…` (feature `postgres`,
/// `onceflow_postgres::PostgresCheckpointStore`).
///
/// Errors: [`ErrorKind::Config`] for an unknown scheme, [`ErrorKind::Unsupported`] for
/// `redis://` / `postgres://` in a build without that feature, [`ErrorKind::DedupStore`] for a
/// path or server that cannot be used (naming it, without its password).
pub async fn checkpoint_store(url: &str) -> Result<checkpoint::SharedCheckpointStore> {
    if let Some(e) = absent_store(url, "checkpoint") {
        return Err(e);
    }
    checkpoint::open_with(url, STORES).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store crate the build lacks is named with its feature (Unsupported; Config for its bare
    /// scheme name); one it has, or any other URL, is left to the openers.
    #[test]
    fn absent_stores_are_named_by_crate_and_feature() {
        for (url, feature, krate, present) in [
            (
                "redis://u:pw@h:1",
                "redis",
                "onceflow-redis",
                cfg!(feature = "redis"),
            ),
            (
                "postgresql://h/db",
                "postgres",
                "onceflow-postgres",
                cfg!(feature = "postgres"),
            ),
        ] {
            match absent_store(url, "dedup") {
                None => assert!(present, "{url}"),
                Some(e) => {
                    assert!(!present, "{url}: {e}");
                    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
                    assert!(e.message().contains(krate), "{e}");
                    assert!(e.message().contains(&format!("`{feature}`")), "{e}");
                    assert!(!e.message().contains("pw"), "{e}");
                }
            }
            let bare = url.split("://").next().unwrap_or_default();
            if let Some(e) = absent_store(bare, "checkpoint") {
                assert_eq!(e.kind(), ErrorKind::Config, "{e}");
                assert!(e.message().contains("://"), "{e}");
            }
        }
        assert!(absent_store("memory://", "dedup").is_none());
        assert!(absent_store("./dedup.db", "dedup").is_none());
    }

    #[test]
    fn options_join_the_query_encoded() {
        let u = url_with_options(
            "kafka://h:1",
            [
                ("security.protocol", "SASL_SSL"),
                ("sasl.password", "a&b=c d"),
            ],
        )
        .unwrap();
        assert_eq!(
            u,
            "kafka://h:1?security.protocol=SASL_SSL&sasl.password=a%26b%3Dc+d"
        );
        let u = url_with_options("kafka://h:1?linger.ms=5", [("acks", "all")]).unwrap();
        assert_eq!(u, "kafka://h:1?linger.ms=5&acks=all");
        assert_eq!(url_with_options("nats://h:1", []).unwrap(), "nats://h:1");
        let e = url_with_options("nats://h:1", [(" ", "x")]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let e = url_with_options("nats://u:S3CR3T@h:1#x", [("a", "b")]).unwrap_err();
        assert!(!e.message().contains("S3CR3T"), "{e}");
    }
}
