//! # onceflow-core
//!
//! The platform-neutral heart of onceflow: the message model, the backend traits each platform
//! adapter implements, the idempotent-consumer and pipeline engine, dedup stores, the
//! transactional inbox ([`inbox`]), W3C trace propagation and metrics. It knows no platform;
//! adapters depend on it.
//!
//! Most users depend on the `onceflow` facade crate instead, which re-exports this crate and
//! opens platforms by URL.

pub mod backend;
pub mod checkpoint;
pub mod client;
pub mod dedup;
pub mod engine;
pub mod error;
pub mod inbox;
pub mod metrics;
pub mod model;
pub mod net;
pub mod registry;
pub mod trace;

pub use backend::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, GroupMetadata, Guarantee,
    Isolation, PartitionLag, PlatformBackend, ProducerBackend, ProducerConfig, RebalanceListener,
    TopicDescription, TopicSpec, TransactionBackend,
};
pub use client::{
    Admin, Client, Committed, Consumer, Producer, Transaction, IDEMPOTENCY_KEY_HEADER,
    MAX_PARTITIONS,
};
pub use dedup::{DedupStore, DedupStoreExt};
pub use engine::{
    handler_fn, EngineConfig, Handler, IdempotentConsumer, KeyStrategy, OnFailure, Pipeline,
    PipelineConfig, PipelineMode, RunSummary, Transform, TransformOutput,
};
pub use error::{
    is_secret_key, redact_credentials, redact_url, shown, BoxError, Error, ErrorKind, Result,
};
pub use metrics::{Metrics, MetricsSnapshot};
pub use model::{
    now_ms, Delivery, Header, Headers, Message, Position, Record, StartFrom, TimestampMs,
    TopicPartition, KEY_GENERATION_HEADER,
};
/// The SQLite client, re-exported for embedded inbox handlers (their transaction is a
/// `rusqlite::Transaction` on the embedded store's file; see [`inbox::EmbeddedInbox`]).
pub use rusqlite;
