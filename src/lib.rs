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
//! Platform adapters (`kafka`, `jetstream`, `pulsar`, `kinesis`) and the shared dedup stores
//! (`redis`, `postgres`) are added as features of this crate as they land.

use std::sync::Arc;
use std::time::Duration;

pub use onceflow_core::*;

#[cfg(feature = "memory")]
pub use onceflow_memory as memory;

/// Every platform scheme onceflow knows, compiled in or not.
const KNOWN_SCHEMES: [&str; 5] = ["memory", "kafka", "nats", "pulsar", "kinesis"];

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
    }
    v
}

/// Connects to the platform named by `url`'s scheme: `memory://NAME` (feature `memory`).
///
/// Errors: [`ErrorKind::Config`] for a malformed URL or an unknown scheme (the message names the
/// scheme and lists the supported ones); [`ErrorKind::Unsupported`] for a known platform whose
/// feature is not compiled in; [`ErrorKind::Connect`] when the platform cannot be reached.
pub async fn connect(url: &str) -> Result<Client> {
    let scheme = url.split_once("://").map(|(s, _)| s).ok_or_else(|| {
        Error::config(format!(
            "'{url}' is not a platform URL: expected SCHEME://..., one of {}",
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
        "kafka" => Ok(Client::new(onceflow_kafka::connect(url)?)),
        #[cfg(feature = "jetstream")]
        "nats" => Ok(Client::new(onceflow_jetstream::connect(url).await?)),
        s if KNOWN_SCHEMES.contains(&s) => Err(Error::unsupported(format!(
            "'{scheme}://' is not compiled into this build of onceflow (enable its cargo feature); supported here: {}",
            supported_schemes().join(", ")
        ))),
        other => Err(Error::config(format!(
            "unknown platform scheme '{other}://' in '{url}': expected one of {}",
            supported_schemes().join(", ")
        ))),
    }
}

/// Opens a dedup store by URL: `memory://` (bounded, in-process), `embedded:///path/to/file.db`
/// or a plain file path (on disk, survives restarts). Completed keys are remembered for
/// `window`.
///
/// Errors: [`ErrorKind::Config`] for an unknown scheme, [`ErrorKind::DedupStore`] for a path
/// that cannot be opened (naming it).
pub async fn dedup_store(url: &str, window: Duration) -> Result<Arc<dyn DedupStore>> {
    onceflow_core::dedup::open(url, window).await
}
