//! # onceflow-memory
//!
//! The `memory://` backend: an in-process log with the semantics of Kafka, for fast unit tests
//! and the demo. It never replaces tests against real brokers, but where Kafka's semantics are
//! the model it behaves like Kafka.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> onceflow_core::Result<()> {
//! use onceflow_core::{PlatformBackend, ProducerConfig, Record};
//! let platform = onceflow_memory::connect("memory://docs?partitions=3")?;
//! let producer = platform.producer(ProducerConfig::default()).await?;
//! let d = producer.send(Record::new("orders", "hello").key("k1")).await?;
//! assert_eq!(d.partition, onceflow_memory::partition_for_key(b"k1", 3));
//! # Ok(()) }
//! ```
//!
//! ## URL
//! `memory://NAME?partitions=N&auto_create=BOOL&max_record_bytes=N`. The same `NAME` in one
//! process is the same broker (`memory://` is `default`); a broker lives until
//! [`MemoryPlatform::forget`]. `partitions` (default 1) is the partition count of topics created
//! automatically on first produce; with `auto_create=false` producing to a missing topic is a
//! `NotFound` error naming it. `max_record_bytes` defaults to 1 MiB. See [`MemoryOptions`].
//!
//! ## Semantics
//! - **Topics and partitions.** Offsets from 0 per partition. Keyed records go where Kafka's
//!   default partitioner puts them (murmur2, [`partition_for_key`]); records without key go
//!   round-robin; an explicit partition wins. The timestamp is the record's or now (CreateTime).
//! - **Consumer groups** (KIP-429 cooperative-sticky). Assignment is balanced and sticky. When a
//!   member joins or leaves, only partitions that move are revoked: at the old owner's next
//!   `poll` its listener's `on_revoked` runs and the positions it returns are committed; only then
//!   can the new owner take them (`on_assigned` at its `poll`). A member that does not poll for
//!   its session timeout (default 10 s, [`ConsumerConfig::session_timeout`]) is removed: its
//!   partitions move, and at its next poll it gets `on_lost` and rejoins with a new member id.
//!   Every rebalance bumps the group generation. Committing a partition the member does not own
//!   is `Fenced`. Explicit start positions (earliest, latest, position, timestamp) apply the first
//!   time a consumer handle is assigned a partition; afterwards the committed position wins.
//! - **nack** rewinds the partition to the message (no per-message nack, like Kafka); a delay
//!   holds the partition back that long. `delivery_count` counts deliveries per group.
//! - **Transactions** (KIP-98, KIP-447). Records sent in a transaction are appended with their
//!   offsets at send time; read-committed consumers read only up to the last stable offset and
//!   skip aborted records; read-uncommitted consumers see everything. Each commit or abort writes
//!   one control record per partition touched (it takes an offset and is never delivered, as on
//!   Kafka, so offsets of transactional topics have gaps). A new producer with the same
//!   transactional id bumps the epoch, aborts what the old one left open and fences it.
//!   Transactional offset commits are fenced at commit when the metadata's generation is older
//!   than the group's and a partition in it is no longer owned by that member. A transactional
//!   producer writes only inside a transaction (plain `send` joins the open one, as Kafka's
//!   `produce` does; without one it is a `Config` error).
//! - **Lag** is high watermark − committed position (log start when nothing is committed).
//! - **Faults** for engine tests: [`MemoryPlatform::faults`].
//!
//! Retention settings are stored and described but not enforced; compaction is not supported.
//!
//! [`ConsumerConfig::session_timeout`]: onceflow_core::ConsumerConfig::session_timeout

mod admin;
mod broker;
mod config;
mod consumer;
mod faults;
mod group;
mod partitioner;
mod producer;

/// This adapter's entry in the backend registry (`onceflow_core::registry`): the schemes
/// `memory://` and how to connect, [`connect`]. The `onceflow` facade lists it.
pub const PLATFORM: onceflow_core::registry::PlatformEntry =
    onceflow_core::registry::PlatformEntry {
        name: "memory",
        schemes: &["memory://"],
        connect: |url, _| {
            onceflow_core::registry::boxed(async move {
                Ok(onceflow_core::registry::client(connect(&url)?))
            })
        },
    };

#[cfg(test)]
mod tests;

use std::sync::Arc;

use async_trait::async_trait;
use onceflow_core::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, PlatformBackend, ProducerBackend,
    ProducerConfig, Result,
};

pub use admin::{MemoryAdmin, MAX_MEMORY_PARTITIONS};
pub use config::{parse_url, MemoryOptions, DEFAULT_BROKER, DEFAULT_MAX_RECORD_BYTES};
pub use consumer::{MemoryConsumer, DEFAULT_SESSION_TIMEOUT};
pub use faults::{CrashPoint, Faults};
pub use partitioner::{murmur2, partition_for_key};
pub use producer::MemoryProducer;

use broker::Broker;

/// What `memory://` can do.
pub const CAPABILITIES: Capabilities = Capabilities {
    transactions: true,
    idempotent_producer: true,
    dedup_by_id: false,
    atomic_batch: true,
    native_headers: true,
    consumer_groups: true,
    seek_by_timestamp: true,
    pause_resume: true,
    per_message_nack: false,
    compaction: false,
    lag_ms: false,
    batch_index_ack: false,
};

/// Opens the `memory://` broker named in `url` (see the crate docs for the parameters).
pub fn connect(url: &str) -> Result<Arc<MemoryPlatform>> {
    MemoryPlatform::connect(url)
}

/// A connection to an in-process broker: the factory of producers, consumers and the admin
/// handle, and the door to fault injection.
pub struct MemoryPlatform {
    broker: Arc<Broker>,
    options: MemoryOptions,
}

impl MemoryPlatform {
    /// Opens the broker named in `url` (`memory://NAME?…`), creating it on first use.
    /// [`onceflow_core::ErrorKind::Config`] for a bad URL, naming the value.
    pub fn connect(url: &str) -> Result<Arc<MemoryPlatform>> {
        let (name, options) = config::parse_url(url)?;
        Ok(Arc::new(MemoryPlatform {
            broker: broker::named(&name),
            options,
        }))
    }

    /// A broker of its own, in no registry (nothing else can connect to it).
    pub fn isolated(options: MemoryOptions) -> Arc<MemoryPlatform> {
        Arc::new(MemoryPlatform {
            broker: Broker::new("isolated"),
            options,
        })
    }

    /// Removes the broker `name` from the registry: the next `connect` to it starts empty.
    /// Handles still open keep using the old one. Returns whether it existed.
    pub fn forget(name: &str) -> bool {
        broker::forget(name)
    }

    /// The broker's name.
    pub fn broker_name(&self) -> &str {
        &self.broker.name
    }

    /// This connection's options.
    pub fn options(&self) -> &MemoryOptions {
        &self.options
    }

    /// Fault injection on this broker.
    pub fn faults(&self) -> Faults {
        Faults {
            broker: self.broker.clone(),
        }
    }

    /// A producer as its concrete type.
    pub fn memory_producer(&self, config: ProducerConfig) -> Result<MemoryProducer> {
        MemoryProducer::new(self.broker.clone(), self.options.clone(), config)
    }

    /// A consumer as its concrete type.
    pub fn memory_consumer(&self, config: ConsumerConfig) -> Result<Arc<MemoryConsumer>> {
        MemoryConsumer::join(self.broker.clone(), config)
    }
}

impl std::fmt::Debug for MemoryPlatform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryPlatform")
            .field("broker", &self.broker.name)
            .field("options", &self.options)
            .finish()
    }
}

#[async_trait]
impl PlatformBackend for MemoryPlatform {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    async fn producer(&self, config: ProducerConfig) -> Result<Arc<dyn ProducerBackend>> {
        Ok(Arc::new(self.memory_producer(config)?))
    }

    async fn consumer(&self, config: ConsumerConfig) -> Result<Arc<dyn ConsumerBackend>> {
        Ok(self.memory_consumer(config)?)
    }

    async fn admin(&self) -> Result<Arc<dyn AdminBackend>> {
        Ok(Arc::new(MemoryAdmin {
            broker: self.broker.clone(),
        }))
    }

    fn max_record_bytes(&self) -> usize {
        self.options.max_record_bytes
    }

    fn max_record_bytes_source(&self) -> Option<&'static str> {
        Some("max_record_bytes on the memory:// URL")
    }
}
