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

/// Every platform scheme onceflow knows, compiled in or not.
/// Every scheme onceflow knows, compiled in or not: `tls://` is NATS over TLS, `pulsar+ssl://`
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

/// URL schemes this build can open, for error messages.
pub fn supported_schemes() -> Vec<&'static str> {
    let mut v = Vec::new();
    if cfg!(feature = "memory") {
        v.push("memory://");
    }
    if cfg!(feature = "kafka") {
        v.push("kafka://");
    }
    if cfg!(feature = "jetstream") {
        v.push("nats://");
        v.push("tls://");
    }
    if cfg!(feature = "pulsar") {
        v.push("pulsar://");
        v.push("pulsar+ssl://");
    }
    if cfg!(feature = "kinesis") {
        v.push("kinesis://");
    }
    v
}

/// Dedup and checkpoint store kinds this build can open with [`dedup_store`], for
/// `onceflow --version` and error messages: `memory://` and `embedded` (a file path or
/// `embedded:///path`) always, `redis://` and `postgres://` with their features.
pub fn supported_stores() -> Vec<&'static str> {
    let mut v = vec!["memory://", "embedded"];
    if cfg!(feature = "redis") {
        v.push("redis://");
    }
    if cfg!(feature = "postgres") {
        v.push("postgres://");
    }
    v
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
    match scheme {
        #[cfg(feature = "memory")]
        "memory" => {
            let p = onceflow_memory::connect(url)?;
            Ok(Client::new(p))
        }
        #[cfg(feature = "kafka")]
        "kafka" => Ok(Client::new(onceflow_kafka::open(url).await?)),
        #[cfg(feature = "jetstream")]
        "nats" | "tls" => Ok(Client::new(onceflow_jetstream::connect(url).await?)),
        #[cfg(feature = "pulsar")]
        "pulsar" | "pulsar+ssl" => Ok(Client::new(onceflow_pulsar::connect(url).await?)),
        #[cfg(feature = "kinesis")]
        "kinesis" => Ok(Client::new(connect_kinesis(url).await?)),
        s if KNOWN_SCHEMES.contains(&s) => Err(Error::unsupported(format!(
            "'{scheme}://' is not compiled into this build of onceflow (enable its cargo feature); supported here: {}",
            supported_schemes().join(", ")
        ))),
        other => Err(Error::config(format!(
            "unknown platform scheme '{}://' in '{}': expected one of {}",
            onceflow_core::shown(other),
            onceflow_core::shown(&redact_credentials(url)),
            supported_schemes().join(", ")
        ))),
    }
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

/// Opens a Kinesis connection; a `checkpoint_store=redis://…` or `postgres://…` lease table is
/// opened here, through the facade's `redis` / `postgres` features (onceflow-kinesis itself
/// opens `memory://` and embedded stores).
#[cfg(feature = "kinesis")]
async fn connect_kinesis(url: &str) -> Result<Arc<onceflow_kinesis::KinesisPlatform>> {
    let options = onceflow_kinesis::parse_url(url)?;
    let store: Option<onceflow_core::checkpoint::SharedCheckpointStore> =
        match options.checkpoint_store.as_deref() {
            #[cfg(feature = "redis")]
            Some(s) if s.starts_with("redis://") || s.starts_with("rediss://") => Some(Arc::new(
                onceflow_redis::RedisCheckpointStore::open(s).await?,
            )),
            #[cfg(feature = "postgres")]
            Some(s) if s.starts_with("postgres://") || s.starts_with("postgresql://") => Some(
                Arc::new(onceflow_postgres::PostgresCheckpointStore::open(s).await?),
            ),
            _ => None,
        };
    onceflow_kinesis::KinesisPlatform::connect_with(options, store).await
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
    let scheme = url
        .trim()
        .split_once("://")
        .map(|(s, _)| s.to_ascii_lowercase())
        .unwrap_or_default();
    if !window.is_zero() {
        match scheme.as_str() {
            #[cfg(feature = "redis")]
            "redis" | "rediss" => {
                return Ok(Arc::new(
                    onceflow_redis::RedisStore::open(url.trim(), window).await?,
                ))
            }
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => {
                return Ok(Arc::new(
                    onceflow_postgres::PostgresStore::open(url.trim(), window).await?,
                ))
            }
            _ => {}
        }
    }
    onceflow_core::dedup::open(url, window).await
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
    let scheme = url
        .trim()
        .split_once("://")
        .map(|(s, _)| s.to_ascii_lowercase())
        .unwrap_or_default();
    match scheme.as_str() {
        #[cfg(feature = "redis")]
        "redis" | "rediss" => Ok(Arc::new(
            onceflow_redis::RedisCheckpointStore::open(url.trim()).await?,
        )),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Arc::new(
            onceflow_postgres::PostgresCheckpointStore::open(url.trim()).await?,
        )),
        _ => checkpoint::open(url).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
