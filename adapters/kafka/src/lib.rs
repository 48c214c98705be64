//! # onceflow-kafka
//!
//! The `kafka://` backend of onceflow, on [rdkafka](https://docs.rs/rdkafka) with its bundled
//! librdkafka.
//!
//! ```no_run
//! # async fn demo() -> onceflow_core::Result<()> {
//! use onceflow_core::{PlatformBackend, ProducerConfig, Record};
//! let platform = onceflow_kafka::connect("kafka://127.0.0.1:9092?linger.ms=5")?;
//! let producer = platform.producer(ProducerConfig::default()).await?;
//! let d = producer.send(Record::new("orders", "hello").key("k1")).await?;
//! println!("written at {}[{}] {}", d.topic, d.partition, d.position);
//! # Ok(()) }
//! ```
//!
//! ## URL
//! `kafka://HOST:PORT[,HOST:PORT…][?KEY=VALUE&…]`. The hosts become `bootstrap.servers`; every
//! query parameter is handed verbatim to librdkafka as a client property on producers, consumers
//! and the admin client (for example `?compression.type=lz4&linger.ms=5`). Two keys are read by
//! onceflow as well: `message.max.bytes` sets [`PlatformBackend::max_record_bytes`] (default
//! [`DEFAULT_MAX_RECORD_BYTES`], 1 048 491 bytes: what fits alone in a record batch under a
//! default broker's `message.max.bytes` of 1 048 588). A record is also checked the way
//! librdkafka checks it against the producer's `message.max.bytes` (36 bytes of worst-case
//! record framing and each header's varint lengths), so one near the limit fails with
//! onceflow's error naming it. A producer's options may lower `message.max.bytes`, not raise
//! it above the connection's (a larger limit goes on the URL). The value is decimal digits in
//! librdkafka's range, 1000 to 1 000 000 000. A record the broker still refuses (over the
//! topic's `max.message.bytes`) is a Config error naming that setting. The second key,
//! `onceflow.timeout.ms` (not passed to librdkafka), bounds blocking calls such as transaction
//! commits and synchronous offset commits (milliseconds, 1 to 3 600 000; default 30 s). See
//! [`KafkaConfig`].
//!
//! ## Semantics
//! - **Producer**: idempotent by default (`enable.idempotence=true`, KIP-98), so retries never
//!   duplicate or reorder; [`ProducerConfig::idempotent`] `Some(false)` turns it off. Every
//!   send waits for its delivery report. Batching and compression are librdkafka's
//!   (`linger.ms`, `batch.size`, `compression.type` via [`ProducerConfig::options`] or the URL).
//!   Headers map one to one onto Kafka record headers (KIP-82): binary values, null distinct
//!   from empty, repeated names kept in order. A batch hands consecutive records for one topic
//!   without partition, timestamp or headers to librdkafka in runs of up to 1024
//!   (`rd_kafka_produce_batch`: one topic lookup, clock reading and lock per run; each record
//!   of a run gets the run's time as its CreateTime); any other record goes alone
//!   (`rd_kafka_producev`). Either way the records keep their order.
//! - **Transactions** (KIP-98, EOS v2 of KIP-447): a [`ProducerConfig::transactional_id`] turns
//!   the producer transactional. `init_transactions` runs once per native producer (fencing
//!   older producers with the same id); `begin` / `send` / `commit_offsets`
//!   (`send_offsets_to_transaction` with the consumer's `ConsumerGroupMetadata` and its delivered
//!   positions, carried in [`GroupMetadata::native`]) / `commit` / `abort`. librdkafka's blocking transaction calls run
//!   on `tokio::task::spawn_blocking`, never on the async executor. `send_batch` enqueues every
//!   record, in order, then has them sent at once rather than after `linger.ms` (the call
//!   has handed over all it has), before awaiting the delivery reports. Errors map as
//!   follows: producer fencing (`PRODUCER_FENCED`, `INVALID_PRODUCER_EPOCH`, `_FENCED`) →
//!   [`ErrorKind::Fenced`],
//!   not retriable, and the producer refuses further transactions; consumer-group fencing of
//!   KIP-447 (`ILLEGAL_GENERATION`, `UNKNOWN_MEMBER_ID`, `FENCED_INSTANCE_ID`,
//!   `REBALANCE_IN_PROGRESS` from `send_offsets_to_transaction`) → a *retriable*
//!   [`ErrorKind::Fenced`]: the transaction is aborted, the producer goes on (the pipeline
//!   re-reads from the committed positions); abortable (`txn_requires_abort`) → [`ErrorKind::Aborted`]
//!   (a failed commit is aborted for you); retriable → retriable errors; fatal →
//!   [`ErrorKind::Platform`] and a fresh native producer for the next transaction; a commit
//!   that times out → [`ErrorKind::Timeout`] with [`onceflow_core::Error::outcome_unknown`],
//!   after the native producer was re-created and re-initialised (InitProducerId bumps the
//!   epoch, fencing the old producer, and the coordinator completes or aborts the pending
//!   transaction), so the group's committed positions read after the error are final; if that
//!   re-initialisation fails, `settle_transactions` retries it and the next `begin` does too.
//! - **Consumer**: a consumer group with `partition.assignment.strategy=cooperative-sticky`
//!   (KIP-429 incremental cooperative rebalancing) by default, `enable.auto.commit=false`,
//!   `isolation.level=read_committed` unless [`Isolation::ReadUncommitted`], and
//!   `fetch.queue.backoff.ms=10` (librdkafka's 1 s idles a reader that drains its 100 000
//!   prefetched messages faster than that; any of these can be overridden). Rebalance callbacks
//!   run inside [`ConsumerBackend::poll`]: on revocation the listener's positions are committed
//!   synchronously before the partitions are given up; on a lost assignment `on_lost` is called.
//!   Commits take the last finished position and commit the next offset to read: offset + 1,
//!   or, where nothing delivered lies past it, the consumer's position
//!   (`rd_kafka_position`), which librdkafka moves past transaction markers and aborted
//!   records it never delivers (KAFKA-6607): the same in a plain commit, on revocation and in
//!   `send_offsets_to_transaction`; `commit_skipped` commits such a position where nothing was
//!   delivered at all (an aborted transaction after the last commit). Lag after
//!   transactional input reaches 0.
//!   Start positions: committed (else `auto.offset.reset` earliest/latest, or an explicit
//!   offset or timestamp fallback), earliest, latest, an offset (past the high watermark: the
//!   partition's end, not `auto.offset.reset`), or a timestamp (ListOffsets
//!   by time, KIP-79; when no record is at or after it, the partition's end, never 0). Explicit
//!   start positions apply the first time this consumer handle is assigned a partition;
//!   afterwards the committed position wins. `nack` rewinds the partition to the message
//!   (Kafka has no per-message redelivery): librdkafka drops the already fetched later
//!   messages of that partition. Lag is the high watermark minus the committed offset (log
//!   start when nothing is committed).
//! - **Admin**: create / describe / delete topics with partitions, `retention.ms`,
//!   `retention.bytes` and `cleanup.policy=compact`; the replication factor is the broker's
//!   default (KIP-464) unless `replication.factor` is given in [`TopicSpec::options`].
//!
//! [`ProducerConfig::options`]: onceflow_core::ProducerConfig::options
//! [`ProducerConfig::idempotent`]: onceflow_core::ProducerConfig::idempotent
//! [`ProducerConfig::transactional_id`]: onceflow_core::ProducerConfig::transactional_id
//! [`GroupMetadata::native`]: onceflow_core::GroupMetadata::native
//! [`ErrorKind::Fenced`]: onceflow_core::ErrorKind::Fenced
//! [`ErrorKind::Aborted`]: onceflow_core::ErrorKind::Aborted
//! [`ErrorKind::Platform`]: onceflow_core::ErrorKind::Platform
//! [`ErrorKind::Timeout`]: onceflow_core::ErrorKind::Timeout
//! [`Isolation::ReadUncommitted`]: onceflow_core::Isolation::ReadUncommitted
//! [`ConsumerBackend::poll`]: onceflow_core::ConsumerBackend::poll
//! [`TopicSpec::options`]: onceflow_core::TopicSpec::options

mod admin;
mod config;
mod consumer;
mod errors;
mod producer;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, PlatformBackend,
    ProducerBackend, ProducerConfig, Result,
};
use rdkafka::error::RDKafkaErrorCode;

pub use admin::KafkaAdmin;
pub use config::{
    parse_url, KafkaConfig, BROKER_DEFAULT_MESSAGE_MAX_BYTES, DEFAULT_MAX_RECORD_BYTES,
    DEFAULT_TIMEOUT,
};
pub use consumer::KafkaConsumer;
pub use producer::KafkaProducer;

/// What Kafka can do through this adapter.
pub const CAPABILITIES: Capabilities = Capabilities {
    transactions: true,
    idempotent_producer: true,
    dedup_by_id: false,
    atomic_batch: false,
    native_headers: true,
    consumer_groups: true,
    seek_by_timestamp: true,
    pause_resume: true,
    per_message_nack: false,
    compaction: true,
    lag_ms: false,
    batch_index_ack: false,
};

/// Opens a Kafka cluster from a `kafka://` URL (see the crate docs). Nothing is contacted
/// until the first producer, consumer or admin call: a wrong address shows only then, after
/// librdkafka's request timeouts. [`open`] checks the cluster first.
///
/// Errors: [`ErrorKind::Config`] for a malformed URL (see [`parse_url`]).
pub fn connect(url: &str) -> Result<Arc<KafkaPlatform>> {
    Ok(Arc::new(KafkaPlatform {
        config: parse_url(url)?,
    }))
}

/// The longest [`KafkaPlatform::check`] waits for a metadata answer (less when
/// `onceflow.timeout.ms` is lower).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens a Kafka cluster from a `kafka://` URL, like [`connect`], and then
/// [checks](KafkaPlatform::check) that a broker answers. `onceflow::connect` uses this.
///
/// Errors: those of [`connect`] and of [`KafkaPlatform::check`].
pub async fn open(url: &str) -> Result<Arc<KafkaPlatform>> {
    let platform = connect(url)?;
    platform.check().await?;
    Ok(platform)
}

/// How long one metadata request of [`KafkaPlatform::check`] waits before the check looks at
/// what the client's error callback reported.
const CHECK_ROUND: Duration = Duration::from_millis(200);

/// Whether librdkafka's reason says our TLS refused the broker's certificate (untrusted CA,
/// wrong host name, expired): OpenSSL's "certificate verify failed", whatever error code
/// carries it (`_SSL`, or `_TRANSPORT` when the event arrives after the connection closed).
fn untrusted_broker(reason: &str) -> bool {
    reason.contains("certificate verify failed")
}

/// What [`CheckContext`] saw end a connection attempt: a refusal (`auth`) or a security
/// protocol that does not match the listener, with librdkafka's reason.
#[derive(Debug, Clone)]
struct Refusal {
    auth: bool,
    reason: String,
}

impl Refusal {
    fn error(&self, servers: &str) -> Error {
        if self.auth {
            Error::new(
                ErrorKind::Auth,
                format!(
                    "Kafka at {servers} refused the connection: {} (check the SASL mechanism, \
                     user name and password or token, and the CA that signed the broker's \
                     certificate: ssl.ca.location / ssl.ca.pem)",
                    self.reason
                ),
            )
        } else {
            Error::new(
                ErrorKind::Connect,
                format!(
                    "Kafka at {servers} does not speak the security protocol the URL sets: {} \
                     (security.protocol PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL must match \
                     the listener's)",
                    self.reason
                ),
            )
            .retriable(false)
        }
    }
}

/// The client context of [`KafkaPlatform::check`]: keeps the first refusal librdkafka reports
/// (an error event, read by polling the consumer, with the reason of librdkafka's last `FAIL`
/// log line; a consumer's error events come through its poll, never the error callback), and
/// forwards librdkafka's log lines to `tracing` at debug level.
#[derive(Default)]
struct CheckContext {
    refusal: parking_lot::Mutex<Option<Refusal>>,
    last_failure: parking_lot::Mutex<Option<String>>,
}

impl CheckContext {
    fn refusal(&self) -> Option<Refusal> {
        self.refusal.lock().clone()
    }

    /// Keeps a refusal of `code` for `reason`, if it is one (see [`Refusal`]).
    fn note(&self, code: RDKafkaErrorCode, reason: &str) {
        // A TLS client at a plaintext listener fails its handshake ("wrong version number",
        // "packet length too long"); a plaintext client at a TLS or SASL listener is
        // disconnected while it asks for ApiVersions, and librdkafka says so.
        let tls_at_plaintext = reason.contains("PLAINTEXT broker listener")
            || code == RDKafkaErrorCode::SSL
                && [
                    "wrong version number",
                    "packet length too long",
                    "record layer failure",
                ]
                .iter()
                .any(|s| reason.contains(s));
        let plaintext_at_tls = reason.contains("incorrect security.protocol");
        // The broker refused our certificate with a TLS alert (bad_certificate 42,
        // certificate_expired 45, unknown_ca 48, certificate_required 116, RFC 8446 §6.2),
        // seen by the read after the handshake as a transport failure.
        let certificate_refused = matches!(
            code,
            RDKafkaErrorCode::BrokerTransportFailure | RDKafkaErrorCode::SSL
        ) && reason.contains("alert")
            && (reason.contains("certificate") || reason.contains("unknown ca"));
        let auth = if tls_at_plaintext || plaintext_at_tls {
            false
        } else if certificate_refused || untrusted_broker(reason) || errors::is_auth(code) {
            true
        } else {
            return;
        };
        self.refusal.lock().get_or_insert(Refusal {
            auth,
            reason: reason.to_string(),
        });
    }

    /// Notes the error events queued on `consumer` since the last call.
    fn drain(consumer: &rdkafka::consumer::BaseConsumer<CheckContext>) {
        while let Some(Err(e)) = consumer.poll(Duration::ZERO) {
            let Some(code) = e.rdkafka_error_code() else {
                continue;
            };
            let context = rdkafka::consumer::Consumer::context(consumer);
            let reason = context
                .last_failure
                .lock()
                .clone()
                .unwrap_or_else(|| e.to_string());
            context.note(code, &reason);
        }
    }
}

impl rdkafka::client::ClientContext for CheckContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel as L;
        // Debug only: a failure the check ends on is its error, told once, by the caller.
        tracing::debug!(target: "librdkafka", "connection check: {fac} {message}");
        if matches!(
            level,
            L::Emerg | L::Alert | L::Critical | L::Error | L::Warning
        ) && matches!(fac, "FAIL" | "ERROR")
        {
            *self.last_failure.lock() = Some(message.to_string());
        }
    }
}

impl rdkafka::consumer::ConsumerContext for CheckContext {}

/// A Kafka cluster: the factory of producers, consumers and the admin handle.
#[derive(Debug, Clone)]
pub struct KafkaPlatform {
    config: KafkaConfig,
}

impl KafkaPlatform {
    /// A platform from a typed configuration.
    pub fn new(config: KafkaConfig) -> Arc<KafkaPlatform> {
        Arc::new(KafkaPlatform { config })
    }

    /// This connection's configuration.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// Checks that the cluster answers: one of the bootstrap servers accepts a TCP connection
    /// (5 s each, [`onceflow_core::net::check_reachable`]), then a metadata request is answered
    /// within [`CHECK_TIMEOUT`] (or `onceflow.timeout.ms` if lower), with the connection's
    /// security settings, so a wrong listener, protocol or credential shows here too. The
    /// request asks for `__consumer_offsets` only and never creates a topic.
    ///
    /// librdkafka retries a refused connection until its timeouts; this check instead ends at
    /// the first refusal the client reports: a SASL authentication failure (wrong password, a
    /// mechanism the listener does not enable, an OAUTHBEARER token that could not be had or
    /// was refused), a TLS handshake that failed (untrusted or mismatched certificate, a client
    /// certificate the broker wants and did not get) or a TLS client at a plaintext listener.
    /// (A plaintext client at a TLS listener gets no answer at all: that one waits for the
    /// check's timeout and is a Connect error asking about the security protocol.)
    ///
    /// Errors: [`ErrorKind::Auth`] naming the servers and librdkafka's reason for a refused
    /// credential or certificate; [`ErrorKind::Connect`] naming the servers when none accepts a
    /// connection, none answers in time (for example a port that is not a Kafka listener) or
    /// the security protocol does not match the listener's; otherwise the native error's kind.
    /// No property value (a password, a key) is part of any of them.
    pub async fn check(&self) -> Result<()> {
        let servers: Vec<&str> = self
            .config
            .bootstrap_servers
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        let mut native = self.config.client_config(&BTreeMap::new());
        native.set("allow.auto.create.topics", "false");
        let timeout = CHECK_TIMEOUT.min(self.config.timeout);
        let redacted = onceflow_core::redact_credentials(&self.config.bootstrap_servers);
        // The client first: a property librdkafka refuses (an unknown name, a bad value, an
        // unsupported SASL mechanism) is a Config error whether or not a broker is up.
        let c = {
            let servers = redacted.clone();
            tokio::task::spawn_blocking(move || {
                native
                    .create_with_context::<_, rdkafka::consumer::BaseConsumer<CheckContext>>(
                        CheckContext::default(),
                    )
                    .map_err(|e| errors::map(e, format_args!("Kafka client for {servers}")))
            })
            .await
            .map_err(|e| errors::join(e, "Kafka connection check"))??
        };
        onceflow_core::net::check_reachable("Kafka", &servers, onceflow_core::net::REACH_TIMEOUT)
            .await?;
        let servers = redacted;
        tokio::task::spawn_blocking(move || {
            use rdkafka::consumer::Consumer;
            let deadline = std::time::Instant::now() + timeout;
            loop {
                // Short rounds, so a refusal reported by the error callback ends the wait.
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let round = left.min(CHECK_ROUND);
                let asked = std::time::Instant::now();
                let result = c.fetch_metadata(Some("__consumer_offsets"), round);
                CheckContext::drain(&c);
                if let Some(refusal) = c.context().refusal() {
                    return Err(refusal.error(&servers));
                }
                match result {
                    Ok(_) => return Ok(()),
                    Err(e)
                        if e.rdkafka_error_code().is_some_and(|c| {
                            matches!(
                                c,
                                RDKafkaErrorCode::OperationTimedOut
                                    | RDKafkaErrorCode::RequestTimedOut
                                    | RDKafkaErrorCode::AllBrokersDown
                                    | RDKafkaErrorCode::BrokerTransportFailure
                            )
                        }) =>
                    {
                        if left > round {
                            // "All brokers down" comes back at once: wait out the round.
                            std::thread::sleep(round.saturating_sub(asked.elapsed()));
                            continue;
                        }
                        let failure = rdkafka::consumer::Consumer::context(&c)
                            .last_failure
                            .lock()
                            .clone();
                        // The handshake's refusal reached the log but not (yet) an error event:
                        // still a refusal, not a broker that never answered.
                        if let Some(f) = failure.as_deref().filter(|f| untrusted_broker(f)) {
                            let refusal = Refusal {
                                auth: true,
                                reason: f.to_string(),
                            };
                            return Err(refusal.error(&servers));
                        }
                        let last = failure
                            .map(|f| format!(", last failure: {f}"))
                            .unwrap_or_default();
                        return Err(Error::new(
                            ErrorKind::Connect,
                            format!(
                                "no Kafka broker at {servers} answered a metadata request \
                                 within {} ms ({e}{last}); a TCP connection was accepted: is \
                                 it a Kafka listener, with the security protocol the URL sets?",
                                timeout.as_millis()
                            ),
                        )
                        .with_source(e));
                    }
                    Err(e) => {
                        return Err(errors::map(
                            e,
                            format_args!("metadata of Kafka at {servers}"),
                        ))
                    }
                }
            }
        })
        .await
        .map_err(|e| errors::join(e, "Kafka check"))?
    }

    /// A producer as its concrete type.
    pub async fn kafka_producer(&self, config: ProducerConfig) -> Result<KafkaProducer> {
        KafkaProducer::new(self.config.clone(), config).await
    }

    /// A consumer as its concrete type.
    pub async fn kafka_consumer(&self, config: ConsumerConfig) -> Result<Arc<KafkaConsumer>> {
        KafkaConsumer::new(self.config.clone(), config).await
    }
}

#[async_trait]
impl PlatformBackend for KafkaPlatform {
    fn name(&self) -> &'static str {
        "kafka"
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    async fn producer(&self, config: ProducerConfig) -> Result<Arc<dyn ProducerBackend>> {
        Ok(Arc::new(self.kafka_producer(config).await?))
    }

    async fn consumer(&self, config: ConsumerConfig) -> Result<Arc<dyn ConsumerBackend>> {
        Ok(self.kafka_consumer(config).await?)
    }

    async fn admin(&self) -> Result<Arc<dyn AdminBackend>> {
        Ok(Arc::new(KafkaAdmin::new(self.config.clone())?))
    }

    fn max_record_bytes(&self) -> usize {
        self.config.max_record_bytes
    }

    fn max_record_bytes_source(&self) -> Option<&'static str> {
        Some("message.max.bytes on the kafka:// URL")
    }

    fn validate_topic(&self, topic: &str) -> Result<()> {
        admin::validate_name(topic)
    }
}

/// This adapter's entry in the backend registry (`onceflow_core::registry`): the schemes
/// `kafka://` and how to connect, [`open`]: a broker must answer. The `onceflow` facade lists it.
pub const PLATFORM: onceflow_core::registry::PlatformEntry =
    onceflow_core::registry::PlatformEntry {
        name: "kafka",
        schemes: &["kafka://"],
        connect: |url, _| {
            onceflow_core::registry::boxed(async move {
                Ok(onceflow_core::registry::client(open(&url).await?))
            })
        },
    };
