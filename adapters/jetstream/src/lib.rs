//! # onceflow-jetstream
//!
//! The NATS JetStream backend of onceflow (`nats://`), on [async-nats]. It maps onceflow's
//! model onto JetStream as follows.
//!
//! ## URL
//! `nats://host:port[,host:port]?key=value&…`, keys in [`JetStreamOptions`] (for example
//! `nats://127.0.0.1:4222?partitions=4&ack_wait_ms=10000`). Unknown keys are a `Config` error.
//! Several servers share one scheme and one set of credentials (`nats://a:4222,b:4222`, each
//! may repeat the scheme: `nats://a:4222,nats://b:4222`).
//!
//! ## Secured connections (TLS, credentials)
//! All through async-nats' own options ([`async_nats::ConnectOptions`]); the URL accepts:
//!
//! | URL | what it does | NATS docs |
//! |---|---|---|
//! | `tls://host:port`, or `nats://host:port?tls=true` | TLS required (async-nats `require_tls`); without it a `nats://` connection still upgrades when the server requires TLS | [TLS] |
//! | `tls_ca=/path/ca.pem` | trust only the CA certificate(s) in this PEM file (default: the system's roots) | [TLS] |
//! | `tls_cert=/path/client.pem&tls_key=/path/client.key` | client certificate and its key (PEM) for mutual TLS; both or neither | [TLS] |
//! | `tls_first=true` | TLS handshake before the server's `INFO`, for servers with `handshake_first` (nats-server ≥ 2.10.4) | [TLS first] |
//! | `nats://user:password@host`, or `?user=…&password=…` | user + password (user info percent-decoded) | [user/password] |
//! | `nats://TOKEN@host`, or `?token=…` | token | [token] |
//! | `nkey_seed_file=/path/user.nk`, or `nkey_seed=SU…` | NKey: the client signs the server's nonce with the user seed (the file's line starting with `S`, read at connect time) | [NKey] |
//! | `creds=/path/user.creds` | decentralized JWT auth: user JWT + seed from a `.creds` file (`nsc generate creds`) | [creds] |
//!
//! Any `tls_*` key implies `tls=true`; `tls=false` with a `tls://` URL or a `tls_*` key is a
//! `Config` error, and so is more than one kind of credentials (user/password, token,
//! `nkey_seed`, `nkey_seed_file`, `creds`), a user without a password, `tls_cert` without
//! `tls_key`, a seed that is not an NKey user seed (`SU…`), or an unreadable file (the error
//! names the option and the path). These keys ([`CONNECTION_KEYS`]) belong to the URL, not to
//! a consumer's options. Passwords, tokens and seeds never appear in errors, logs or
//! `Debug` output (`***`); the URL's user info is moved out of [`JetStreamOptions::servers`]
//! before async-nats sees it.
//!
//! **Errors.** A server refusing the credentials (authorization violation), a server
//! certificate not signed by the trusted CA, or a client certificate missing or refused is
//! [`ErrorKind::Auth`], naming the servers and the kind of
//! credentials (`user 'app' with a password`, `NKey user U…`, the creds file's path): the
//! first connect tries each server once (no `retry_on_initial_connect`), each attempt bounded
//! by `request_timeout_ms`, so a wrong password fails in milliseconds. Only a connection made
//! once reconnects without end (a restarting server). A server that cannot be reached is
//! `Connect`.
//!
//! [TLS]: https://docs.nats.io/using-nats/developer/connecting/tls
//! [TLS first]: https://docs.nats.io/running-a-nats-service/configuration/securing_nats/tls
//! [user/password]: https://docs.nats.io/using-nats/developer/connecting/userpass
//! [token]: https://docs.nats.io/using-nats/developer/connecting/token
//! [NKey]: https://docs.nats.io/using-nats/developer/connecting/nkey
//! [creds]: https://docs.nats.io/using-nats/developer/connecting/creds
//!
//! ## Topics, partitions, order
//! - A **topic is a stream** of the same name (stream names cannot hold `.`, `*`, `>`,
//!   whitespace, `/` or `\`; such topic names are a `Config` error).
//! - **Partitions are subjects**: a topic with one partition owns the subject `<topic>` (partition
//!   0); a topic with `N > 1` partitions owns `<topic>.*` and partition `p` is the subject
//!   `<topic>.<p>`. The partition count is stored in the stream metadata
//!   (`onceflow.partitions`, [ADR-33]). A keyed record goes to partition
//!   `xxh3_64(key) % N`, an unkeyed one round-robin, an explicit partition wins. Other clients
//!   (nats-py, the `nats` CLI) publish to these subjects directly.
//! - **Order**: JetStream orders a stream; onceflow consumes each partition through its own
//!   durable consumer (filter subject = the partition subject) owned by one member of the
//!   group at a time, so a group reads every partition in order and different partitions in
//!   parallel. Across partitions there is no order.
//! - **Positions** are stream sequences ([`onceflow_core::Position::Sequence`]).
//! - The record key travels in the `onceflow-key` header (`onceflow-key-hex` when it is not
//!   text), the record timestamp in `onceflow-timestamp`: JetStream messages have neither. A
//!   message's timestamp is the record's, else the server's publish time.
//!
//! ## Producer
//! - Every record carries `Nats-Msg-Id` ([ADR-31], [JetStream dedup]): its
//!   [`onceflow_core::Record::idempotency_key`], or a random id per `send` when it has none
//!   (so a retry of that send is deduplicated too). A publish that times out is retried with the
//!   same id (`publish_retries`); a `duplicate` ack is success, and
//!   [`onceflow_core::Delivery::duplicate`] reports it (the position is the original one).
//!   Dedup holds within the stream's duplicate window (`duplicate_window_ms`, server default
//!   2 min): a dedup store whose window is shorter loses nothing but a platform-side replay
//!   older than the window is not deduplicated by the server.
//!   [`JetStreamPlatform::check_dedup_window`] warns once per topic when a dedup store's
//!   window is shorter than the stream's duplicate window.
//! - `send_atomic` uses atomic batch publish ([ADR-50], nats-server ≥ 2.12, streams created
//!   with `allow_atomic`, the default here): `Nats-Batch-Id`, `Nats-Batch-Sequence`,
//!   `Nats-Batch-Commit`; all records are stored or none (at most 1000 per batch, server limit).
//! - No transactions: [`Capabilities::transactions`] is `false`; pipelines run
//!   effectively-once (atomic batch + deterministic `Nats-Msg-Id`).
//! - **While JetStream does not answer** (a server restarting or recovering its streams, a
//!   cluster without quorum): a publish nobody answered ("no stream found for given
//!   subject", the server's 503 "no responders") is checked against the JetStream API: a
//!   stream the API says is gone is `NotFound`, otherwise the error is a retriable
//!   `Connect`. API requests nobody answers (async-nats: "requested JetStream resource does
//!   not exist") and "JetStream system temporarily unavailable" (10008) are retriable
//!   `Connect` too, never `NotFound`.
//! - `max_record_bytes` is the server's `max_payload` minus 512 bytes for the headers onceflow
//!   adds.
//!
//! ## Consumer
//! - One **durable pull consumer per group and partition** (`<group>-<partition>`, [ADR-13]),
//!   explicit ack, `ack_wait`, `max_deliver`, `backoff`, `max_ack_pending` from the options.
//!   Its owner pulls with one request at a time (`fetch_batch` messages, 500 ms expiry), so
//!   giving a partition up leaves no request of ours on the server that would swallow the
//!   messages it naks.
//!   A consumer that reconnects resumes its durable at its ack floor, whatever its start: the
//!   start (`Earliest`, `Latest`, a position, a timestamp, or the fallback of
//!   [`StartFrom::Committed`](onceflow_core::StartFrom::Committed)) is the deliver policy of a
//!   durable created now, as Kafka's `auto.offset.reset` applies only to a group without
//!   committed offsets. An explicit start meeting an existing durable logs a warning; the
//!   consumer option `reset=true` deletes the durable and creates it again at the start (the
//!   group's progress on that partition is forgotten; every member joining with it resets).
//!   A durable reopened with other `ack_wait`, `max_deliver`, `max_ack_pending` or `backoff`
//!   is updated in place (consumer update, nats-server ≥ 2.10, [consumer configuration]); a
//!   server that refuses is a `Config` error naming each setting, the durable's value and the
//!   requested one: old settings are never kept silently. With `backoff` the server's
//!   `ack_wait` is the first step.
//!   `pull_expires_ms` (default 500) is each pull request's expiry, `idle_heartbeat_ms`
//!   (default none, at most half the expiry) its idle heartbeat: the server sends one while
//!   the request waits without a message and ends the request with a 408 at its expiry, so a
//!   request that hears nothing for two heartbeats (at least 500 ms) lost its server (a
//!   restart, a server that hangs) or connection and is made again, with one warning per
//!   outage; without a heartbeat that takes 5 s past the expiry (async-nats' batch timeout).
//!   Measured: a consumer reads again 0.45 s after a restart with `idle_heartbeat_ms=100`,
//!   5.4 s without; a hung server (SIGSTOP) is noticed after 0.5 s with a 5 s expiry.
//! - **commit** acks every delivered, not nacked message of the partition up to the position,
//!   and the server confirms them with one double ack ([`AckSync`][ack]) of the last, sent
//!   behind the others on the same connection (acks are handled in the order sent; after a
//!   reconnection in between, or a failure, each is confirmed on its own). The server confirms an ack
//!   however late it is (nats-server 2.14 answers an ack of an expired or redelivered
//!   delivery like a timely one, and it counts), so onceflow reports lateness itself: a
//!   commit of a partition whose owner entry in the group bucket no longer names this
//!   member's claim (it missed its session timeout and another member took over) is
//!   `Fenced` and acks nothing; an ack the server did not answer because the durable is
//!   gone is `Fenced`; an ack sent after the message's ack deadline ran out without an
//!   in-progress signal (a stalled process), or after the server delivered it again, is
//!   acked and reported as a retriable `Timeout` naming the sequences. A member past its
//!   session timeout neither pulls nor sends `+WPI` until its next heartbeat, so what it
//!   holds reaches the new owner after `ack_wait`.
//! - **nack** is a per-message `-NAK` with the delay ([ack]); a nacked message is not acked by a
//!   later commit.
//! - **ack_wait redeliveries to the owner are hidden**: the server redelivers a message whose
//!   `ack_wait` expired even to the member still holding it; the owner polls a message again
//!   only after it nacked it, sought, or the partition moved (a redelivery of a held message
//!   only refreshes its ack handle, one of a committed message is dropped). Other members get
//!   it after `ack_wait` when the owner dies, as JetStream intends. **in_progress** is `+WPI`, which restarts the message's `ack_wait`.
//! - **Held messages do not expire while their owner lives**: every message the server
//!   delivered to this member and nobody acked or nacked yet (prefetched and waiting to be
//!   polled, or polled and waiting for its commit) gets `+WPI` within four fifths of the
//!   shortest ack deadline (`ack_wait`, or the shortest `backoff` step, which the server uses
//!   instead), so a handler or a batch longer than `ack_wait` burns no deliveries: each
//!   counts toward `max_deliver`, after which the server gives the message up or, with
//!   `dead_letter`, onceflow dead-letters it. A member that dies stops signalling, and its
//!   messages reach the next owner after `ack_wait` as before.
//! - **seek** (and an explicit start with `reset=true`): JetStream cannot
//!   change a durable's deliver policy, so the durable is deleted and created again with
//!   `DeliverPolicy::All` / `New` / `ByStartSequence`. A timestamp is resolved to a stream
//!   sequence first: a binary search over the partition's messages (`STREAM.MSG.GET`
//!   `next_by_subject`) for the first one whose timestamp (record or publish time) is at or
//!   after it, assuming timestamps grow with the sequence as Kafka's time index does; none →
//!   the end. Messages fetched but not returned are dropped.
//! - **committed** is the ack floor + 1; **lag** is `num_pending + num_ack_pending`
//!   ([consumer info]); the admin's `group_lag` (and `onceflow lag`) reads the same from the
//!   group's durables without joining the group (`NotFound` for a group with none).
//! - **Headers** are native NATS headers, names with their case ([ADR-4]). NATS header values
//!   are text lines and have no null, and async-nats reads headers into a map, so onceflow adds
//!   `onceflow-headers` (names in order, null and hex marks) and rebuilds the exact list from it:
//!   order, repeats, null vs empty and binary values survive. Values that are not single-line
//!   UTF-8 are hex on the wire. Messages from other clients get their headers sorted by name.
//! - **Consumer groups**: JetStream has no group coordinator, so onceflow keeps membership in
//!   the KV bucket `onceflow_groups` ([`GROUPS_BUCKET`], [ADR-8]): members heartbeat at every
//!   poll (at most every `session_timeout / 4`, between 100 ms and 1 s), partitions are spread
//!   over the live members (sorted; partition `i` to member `i % n`), and a partition's owner
//!   is recorded with compare-and-set. A member that gives a partition up first runs the
//!   listener's `on_revoked`, commits the positions it returns, naks what it fetched and
//!   releases ownership; only then can the next member take it. A member that does not poll
//!   for its session timeout ([`DEFAULT_SESSION_TIMEOUT`] unless set) is taken over and gets
//!   `on_lost` at its next poll. Committing a partition the member does not own is `Fenced`.
//!   Member clocks must agree to well within the session timeout (liveness compares the KV
//!   entry's server time with local time).
//! - **Dead letters after `max_deliver`**: with the consumer option `dead_letter=<topic>` (and
//!   `max_deliver` > 0) the owner of a partition listens for the server's `MAX_DELIVERIES`
//!   advisory and republishes the message the server gave up on to that topic (payload, key,
//!   headers, plus `onceflow-error`, `onceflow-error-kind: ONCEFLOW_MAX_DELIVER`,
//!   `onceflow-attempts`, `onceflow-source-topic/-partition/-position`; `Nats-Msg-Id`
//!   `onceflow-dlq:<stream>:<consumer>:<seq>`), then terminates it (`+TERM`). Advisories are
//!   core NATS messages: one sent while no owner listens is lost (the message then stays
//!   unacked; the engine's own `OnFailure::DeadLetter` does not depend on advisories).
//! - [`ConsumerBackend::group_metadata`] returns the group and member with generation 0, for
//!   information: JetStream has no transactions to commit positions with.
//!
//! [async-nats]: https://docs.rs/async-nats
//! [ADR-4]: https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-4.md
//! [ADR-8]: https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-8.md
//! [ADR-13]: https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-13.md
//! [ADR-31]: https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-31.md
//! [ADR-33]: https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-33.md
//! [ADR-50]: https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-50.md
//! [JetStream dedup]: https://docs.nats.io/using-nats/developer/develop_jetstream/model_deep_dive#message-deduplication
//! [ack]: https://docs.nats.io/using-nats/developer/develop_jetstream/consumers#delivery-reliability
//! [consumer info]: https://docs.nats.io/nats-concepts/jetstream/consumers
//! [consumer configuration]: https://docs.nats.io/nats-concepts/jetstream/consumers#configuration

mod admin;
mod config;
mod connect;
mod consumer;
mod convert;
mod durability;
mod group;
mod naming;
mod producer;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream::Stream};
use async_trait::async_trait;
use onceflow_core::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, PlatformBackend,
    ProducerBackend, ProducerConfig, Result, TopicSpec,
};
use parking_lot::Mutex;

pub use admin::JetStreamAdmin;
pub use config::{parse_url, JetStreamOptions, CONNECTION_KEYS};
pub use consumer::{JetStreamConsumer, DEFAULT_SESSION_TIMEOUT, MIN_SESSION_TIMEOUT};
pub use durability::{DurabilityReport, ServerSync};
pub use group::GROUPS_BUCKET;
pub use naming::{
    durable, partition_for_key, partition_of_subject, subject, KEY_HEADER, KEY_HEX_HEADER,
    ORDER_HEADER, PARTITIONS_METADATA, TIMESTAMP_HEADER,
};
pub use producer::JetStreamProducer;

/// Bytes of `max_payload` kept for the headers onceflow adds (`Nats-Msg-Id`, key, order).
const HEADER_ROOM: usize = 512;

/// What JetStream can do through this adapter.
pub const CAPABILITIES: Capabilities = Capabilities {
    transactions: false,
    idempotent_producer: true,
    dedup_by_id: true,
    atomic_batch: true,
    native_headers: true,
    consumer_groups: true,
    seek_by_timestamp: true,
    pause_resume: true,
    per_message_nack: true,
    compaction: false,
    lag_ms: false,
    batch_index_ack: false,
};

/// Connects to the server named in `url` (see the crate docs).
pub async fn connect(url: &str) -> Result<Arc<JetStreamPlatform>> {
    JetStreamPlatform::connect(url).await
}

/// State shared by the producers, consumers and admin handle of one connection.
pub(crate) struct Shared {
    pub(crate) client: async_nats::Client,
    pub(crate) js: jetstream::Context,
    pub(crate) options: JetStreamOptions,
    /// The subjects of each topic's partitions (index = partition; the length is the partition
    /// count), as read from (or created on) the server. A send clones its subject from here
    /// (a reference count, no allocation).
    topics: Mutex<HashMap<String, Arc<[async_nats::Subject]>>>,
    /// Held while a topic missing from `topics` is looked up, so the first sends of a new topic
    /// (a window of async publishes arrive together) ask the server once, not once each.
    lookup: tokio::sync::Mutex<()>,
    /// Topics whose dedup window mismatch was already warned about.
    window_warned: Mutex<HashSet<String>>,
    /// Topics whose durability risk was already warned about (`require_durable`).
    durability_warned: Mutex<HashSet<String>>,
    /// The server's sync setting once asked ([`DurabilityReport::sync`]).
    server_sync: Mutex<Option<ServerSync>>,
}

/// Partition count of a stream: its `onceflow.partitions` metadata, else 1.
pub(crate) fn partitions_of(cfg: &jetstream::stream::Config) -> u32 {
    cfg.metadata
        .get(PARTITIONS_METADATA)
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 1)
        .unwrap_or(1)
}

/// A stream made by another tool (`nats stream add`) whose subjects are not the topic's
/// partition subjects would be read as empty: a `Config` error naming both layouts instead.
fn check_layout(topic: &str, partitions: u32, subjects: &[String]) -> Result<()> {
    let expected = naming::stream_subjects(topic, partitions);
    if expected.iter().all(|e| subjects.contains(e)) {
        return Ok(());
    }
    Err(Error::config(format!(
        "stream '{topic}' has the subjects [{}], not onceflow's layout for a topic of {partitions} \
         partition(s) [{}]: partition p of topic '{topic}' is the subject '{topic}' (one \
         partition) or '{topic}.p'; create the topic with onceflow, or give the stream these \
         subjects",
        subjects.join(", "),
        expected.join(", ")
    )))
}

impl Shared {
    /// Largest record accepted: the server's `max_payload` minus room for onceflow's headers.
    pub(crate) fn max_record_bytes(&self) -> usize {
        // `max_payload()` reads an atomic the client updates on every server `INFO`;
        // `server_info()` would clone the whole `ServerInfo` (a dozen strings) on every send.
        self.client.max_payload().saturating_sub(HEADER_ROOM)
    }

    /// The durability report of `topic`; with `required` (the `require_durable` option), a
    /// warning (`tracing::warn!`, once per topic and connection) when an acknowledged write
    /// is not known to be synced to disk.
    pub(crate) async fn check_durability(
        &self,
        topic: &str,
        required: bool,
    ) -> Result<DurabilityReport> {
        let mut report = durability::report(self, topic).await?;
        if required {
            if let Some(risk) = report.risk() {
                if self.durability_warned.lock().insert(topic.to_string()) {
                    report.warned = true;
                    tracing::warn!(
                        topic,
                        storage = report.storage,
                        replicas = report.replicas,
                        sync = %report.sync,
                        "require_durable: {risk}"
                    );
                }
            }
        }
        Ok(report)
    }

    pub(crate) fn forget_topic(&self, topic: &str) {
        self.topics.lock().remove(topic);
    }

    /// The stream of `topic`, `NotFound` naming it if there is none.
    pub(crate) async fn get_stream(&self, topic: &str) -> Result<Stream> {
        self.js.get_stream(topic).await.map_err(|e| {
            let err = convert::nats_err(format!("stream '{topic}'"), e);
            if err.kind() == ErrorKind::NotFound {
                Error::new(
                    ErrorKind::NotFound,
                    format!("topic '{topic}' does not exist (no JetStream stream of that name)"),
                )
            } else {
                err
            }
        })
    }

    /// The partition subjects of `topic` if they are known already (no request to the
    /// server).
    pub(crate) fn cached_subjects(&self, topic: &str) -> Option<Arc<[async_nats::Subject]>> {
        self.topics.lock().get(topic).cloned()
    }

    /// Partition count of `topic`; creates the stream when it is missing and `auto_create` is on.
    pub(crate) async fn partitions(&self, topic: &str) -> Result<u32> {
        Ok(self.subjects(topic).await?.len() as u32)
    }

    /// The subjects of `topic`'s partitions (index = partition); creates the stream when it is
    /// missing and `auto_create` is on.
    pub(crate) async fn subjects(&self, topic: &str) -> Result<Arc<[async_nats::Subject]>> {
        if let Some(s) = self.cached_subjects(topic) {
            return Ok(s);
        }
        let _lookup = self.lookup.lock().await;
        if let Some(s) = self.cached_subjects(topic) {
            return Ok(s);
        }
        naming::check_topic(topic)?;
        let n = match self.get_stream(topic).await {
            Ok(s) => {
                let cfg = &s.cached_info().config;
                let n = partitions_of(cfg);
                check_layout(topic, n, &cfg.subjects)?;
                n
            }
            Err(e) if e.kind() == ErrorKind::NotFound && self.options.auto_create => {
                let spec = TopicSpec::new(topic, self.options.partitions);
                let cfg = admin::stream_config(self, &spec)?;
                match self.js.create_stream(cfg).await {
                    Ok(info) => partitions_of(&info.cached_info().config),
                    // Created concurrently by someone else: read it.
                    Err(_) => partitions_of(&self.get_stream(topic).await?.cached_info().config),
                }
            }
            Err(e) => return Err(e),
        };
        if self.options.require_durable {
            self.check_durability(topic, true).await?;
        }
        let subjects: Arc<[async_nats::Subject]> = (0..n as i32)
            .map(|p| async_nats::Subject::from(naming::subject(topic, n, p)))
            .collect();
        self.topics
            .lock()
            .insert(topic.to_string(), subjects.clone());
        Ok(subjects)
    }
}

/// A connection to a NATS server with JetStream: the factory of producers, consumers and the
/// admin handle.
pub struct JetStreamPlatform {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for JetStreamPlatform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamPlatform")
            .field(
                "servers",
                &onceflow_core::redact_credentials(&self.shared.options.servers),
            )
            .finish()
    }
}

impl JetStreamPlatform {
    /// Connects to `url` (`nats://host:port?…` or `tls://host:port?…`, see the crate docs).
    /// `Config` for a bad URL, `Auth` for refused credentials or certificates, `Connect` when
    /// the server cannot be reached or has no JetStream (see [`JetStreamPlatform::connect_with`]).
    pub async fn connect(url: &str) -> Result<Arc<JetStreamPlatform>> {
        let options = parse_url(url)?;
        Self::connect_with(options).await
    }

    /// Connects with typed options (checked by [`JetStreamOptions::validate`] first).
    ///
    /// Errors: `Config` for invalid options or unreadable TLS / credential files; `Auth` when
    /// the server refuses the credentials (authorization violation) or a certificate (ours or
    /// its own); `Connect` when no server can be reached or none answers JetStream requests.
    /// Each server is tried once (each attempt bounded by `request_timeout_ms`): a refused
    /// credential fails at once, never after retries.
    pub async fn connect_with(options: JetStreamOptions) -> Result<Arc<JetStreamPlatform>> {
        let (co, what) = connect::connect_options(&options).await?;
        let servers: Vec<String> = options.servers.split(',').map(String::from).collect();
        let client = co
            .connect(servers)
            .await
            .map_err(|e| connect::connect_error(e, &options, &what))?;
        let mut js = jetstream::new(client.clone());
        js.set_timeout(options.request_timeout);
        js.query_account().await.map_err(|e| {
            Error::new(
                ErrorKind::Connect,
                format!(
                    "NATS at {} does not answer JetStream requests (is it started with -js?): {e}",
                    onceflow_core::redact_credentials(&options.servers)
                ),
            )
            .with_source(e)
        })?;
        Ok(Arc::new(JetStreamPlatform {
            shared: Arc::new(Shared {
                client,
                js,
                options,
                topics: Mutex::new(HashMap::new()),
                lookup: tokio::sync::Mutex::new(()),
                window_warned: Mutex::new(HashSet::new()),
                durability_warned: Mutex::new(HashSet::new()),
                server_sync: Mutex::new(None),
            }),
        }))
    }

    /// The connection's options.
    pub fn options(&self) -> &JetStreamOptions {
        &self.shared.options
    }

    /// The async-nats client, for anything onceflow does not cover.
    pub fn nats_client(&self) -> async_nats::Client {
        self.shared.client.clone()
    }

    /// What the stream of `topic` promises about an acknowledged write: its storage (`file` /
    /// `memory`), replica count and the server's `sync_interval` when this client can read
    /// it (only a system-account user can: [`ServerSync::Unknown`] otherwise; the setting is
    /// on the server's monitoring endpoint, `/varz`). With the `require_durable` option (URL
    /// or consumer) a stream that is not known to be durable on ack gets a warning
    /// (`tracing::warn!`, once per topic and connection) here, at a consumer's join and when
    /// a producer first uses the topic. `NotFound` when the topic has no stream.
    pub async fn durability(&self, topic: &str) -> Result<DurabilityReport> {
        self.shared
            .check_durability(topic, self.shared.options.require_durable)
            .await
    }

    /// The duplicate window of the stream of `topic` (`Nats-Msg-Id` dedup horizon), for
    /// comparing with a dedup store's window.
    pub async fn duplicate_window(&self, topic: &str) -> Result<Duration> {
        let s = self.shared.get_stream(topic).await?;
        Ok(s.cached_info().config.duplicate_window)
    }

    /// Compares a dedup store's window (`DedupStore::window`) with the duplicate window of the
    /// stream of `topic`, and logs a warning (`tracing::warn!`, once per topic and connection)
    /// when the store's is shorter: a message redelivered or replayed after the store forgot
    /// its key but while the server still remembers the `Nats-Msg-Id`s of its outputs runs its
    /// handler again (side effects repeat) while its outputs are dropped as duplicates.
    pub async fn check_dedup_window(
        &self,
        topic: &str,
        store_window: Duration,
    ) -> Result<DedupWindowCheck> {
        let stream_window = self.duplicate_window(topic).await?;
        let shorter = store_window < stream_window;
        let warned = shorter && self.shared.window_warned.lock().insert(topic.to_string());
        if warned {
            tracing::warn!(
                topic,
                store_window_ms = store_window.as_millis() as u64,
                duplicate_window_ms = stream_window.as_millis() as u64,
                "the dedup store forgets keys sooner than stream '{topic}' forgets Nats-Msg-Ids: \
                 a redelivery in between runs its handler again while its outputs are dropped \
                 as duplicates; give the store a window of at least the duplicate window"
            );
        }
        Ok(DedupWindowCheck {
            store_window,
            stream_window,
            shorter,
            warned,
        })
    }
}

/// What [`JetStreamPlatform::check_dedup_window`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DedupWindowCheck {
    /// The dedup store's window.
    pub store_window: Duration,
    /// The stream's duplicate window.
    pub stream_window: Duration,
    /// The store's window is shorter.
    pub shorter: bool,
    /// This call logged the warning (the first one for the topic on this connection).
    pub warned: bool,
}

#[async_trait]
impl PlatformBackend for JetStreamPlatform {
    fn name(&self) -> &'static str {
        "jetstream"
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    async fn producer(&self, config: ProducerConfig) -> Result<Arc<dyn ProducerBackend>> {
        Ok(Arc::new(JetStreamProducer::new(
            self.shared.clone(),
            config,
        )?))
    }

    async fn consumer(&self, config: ConsumerConfig) -> Result<Arc<dyn ConsumerBackend>> {
        Ok(JetStreamConsumer::join(self.shared.clone(), config).await?)
    }

    async fn admin(&self) -> Result<Arc<dyn AdminBackend>> {
        Ok(Arc::new(JetStreamAdmin {
            shared: self.shared.clone(),
        }))
    }

    fn max_record_bytes(&self) -> usize {
        self.shared.max_record_bytes()
    }

    fn max_record_bytes_source(&self) -> Option<&'static str> {
        Some("the NATS server's max_payload, less 512 bytes for onceflow's headers")
    }

    fn validate_header(&self, name: &str, value: Option<&[u8]>) -> Result<()> {
        convert::validate_header(name, value)
    }
}

/// This adapter's entry in the backend registry (`onceflow_core::registry`): the schemes
/// `nats://`, `tls://` and how to connect, [`connect`]; `tls://` is NATS over TLS. The `onceflow` facade lists it.
pub const PLATFORM: onceflow_core::registry::PlatformEntry =
    onceflow_core::registry::PlatformEntry {
        name: "jetstream",
        schemes: &["nats://", "tls://"],
        connect: |url, _| {
            onceflow_core::registry::boxed(async move {
                Ok(onceflow_core::registry::client(connect(&url).await?))
            })
        },
    };

#[cfg(test)]
mod tests {
    use super::check_layout;

    #[test]
    fn streams_of_other_layouts_are_named() {
        assert!(check_layout("orders", 1, &["orders".into()]).is_ok());
        assert!(check_layout("orders", 4, &["orders.*".into(), "x".into()]).is_ok());
        let e = check_layout("BRKS6", 1, &["brks6.>".into()]).unwrap_err();
        assert_eq!(e.kind(), onceflow_core::ErrorKind::Config);
        assert!(e.message().contains("[brks6.>]"), "{e}");
        assert!(e.message().contains("[BRKS6]"), "{e}");
    }
}
