//! # onceflow-core
//!
//! The platform-neutral heart of onceflow: the message model, the backend traits each platform
//! adapter implements, the idempotent-consumer and pipeline engine, dedup stores, W3C trace
//! propagation and metrics. It knows no platform; adapters depend on it.
//!
//! Most users depend on the `onceflow` facade crate instead, which re-exports this crate and
//! opens platforms by URL.

pub mod backend;
pub mod dedup;
pub mod error;
pub mod model;

pub use backend::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, GroupMetadata, Guarantee,
    Isolation, PartitionLag, PlatformBackend, ProducerBackend, ProducerConfig, RebalanceListener,
    TopicDescription, TopicSpec, TransactionBackend,
};
pub use dedup::{DedupStore, DedupStoreExt};
pub use error::{BoxError, Error, ErrorKind, Result};
pub use model::{
    now_ms, Delivery, Header, Headers, Message, Position, Record, StartFrom, TimestampMs,
    TopicPartition,
};
