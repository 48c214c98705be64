//! # onceflow-pulsar
//!
//! The Apache Pulsar backend of onceflow (`pulsar://`), on the [pulsar] crate (tokio runtime)
//! plus Pulsar's admin REST API. It maps onceflow's model onto Pulsar as follows.
//!
//! ## URL
//! `pulsar://host:port?admin=http://host:port&key=value&…`, keys in [`PulsarOptions`] (for
//! example `pulsar://127.0.0.1:16650?admin=http://127.0.0.1:18080&batch_size=1000&compression=lz4`).
//! `metadata.KEY=VALUE` is passed verbatim to the broker as producer and consumer metadata;
//! other unknown keys are a `Config` error. Consumer keys (`subscription_type`,
//! `dead_letter`, …) may also be set per consumer in `ConsumerConfig::options`, producer keys
//! per producer in `ProducerConfig::options`.
//!
//! ## Secured clusters (TLS, tokens, OAuth2, client certificates)
//! `pulsar+ssl://host:6651?admin=https://host:8443&tls_trust_certs=/etc/pulsar/ca.pem&token_file=/run/secrets/pulsar-token`
//! connects over TLS (the admin URL defaults to `https://host:8443` there), trusting the CAs
//! of the PEM file besides the public web PKI; the broker's certificate must name the URL's
//! host (verified; only with a client certificate can that be turned off, see below). Credentials, one of (Pulsar's Java names in brackets):
//! - `token=JWT` (`AuthenticationToken`, `token:…`);
//! - `token_file=/path` (`AuthenticationToken`, `file:///path`), read again whenever the file
//!   changes (modification time or length): a rotated token is used from the next connection,
//!   auth challenge or admin call on, without a restart;
//! - `oauth2_issuer_url=https://issuer/&oauth2_credentials_file=/path/key.json`
//!   (optionally `&oauth2_audience=…&oauth2_scope=…`; `AuthenticationOAuth2`, client credentials; the
//!   key file is `{"client_id": …, "client_secret": …}`), done by the pulsar crate's OAuth2
//!   provider, whose HTTP client trusts only the public web PKI.
//!
//! The admin REST calls send the same credential (`Authorization: Bearer`, with
//! `X-Pulsar-Auth-Method-Name: token` as Pulsar's Java admin client does, so a broker with an
//! `anonymousUserRole` refuses a bad token instead of serving it as anonymous) and trust the
//! same CAs. A refused certificate (untrusted issuer, a host name it does not have), a refused
//! credential (wrong, expired or foreign-signed token: the broker's `AuthenticationError`) or a
//! token endpoint that refuses the client is an [`ErrorKind::Auth`] error naming the server,
//! within a second or so: the pulsar crate folds such refusals into one "fatal error", so
//! onceflow connects once more on its own (same CAs, host name and credential, the crate's
//! frame codec) to say which step was refused. Tokens never appear in errors or `Debug`.
//!
//! ## TLS client certificates (mTLS)
//! `pulsar+ssl://host:6651?tls_trust_certs=/etc/pulsar/ca.pem&tls_cert_file=/etc/pulsar/client.pem&tls_key_file=/etc/pulsar/client.key`
//! authenticates with a TLS client certificate ([`PulsarAuth::Tls`], Java's
//! `AuthenticationTls`; the broker's `AuthenticationProviderTls` takes the role from the
//! certificate's common name; Pulsar docs, "Authentication using TLS",
//! <https://pulsar.apache.org/docs/next/security-tls-authentication/>). It is one credential:
//! not together with `token`, `token_file` or `oauth2_*`. The admin REST calls present the same
//! certificate and send `X-Pulsar-Auth-Method-Name: tls`.
//!
//! The pulsar crate (6.9) cannot present a client certificate (its rustls connection is built
//! `with_no_client_auth()`), so **mTLS goes through an in-process loopback bridge**: the crate
//! is given `pulsar://127.0.0.1:PORT/mtls-bridge-to/BROKER:PORT`, a listener of onceflow (the
//! path only names the broker in what the crate logs, such as its `Retry #0 -> connecting …`
//! warning), and each connection it opens there is relayed over a TLS connection that
//! onceflow makes to the broker (client certificate, the CAs of `tls_trust_certs` plus the
//! public web PKI, the broker's host name checked).
//! - Another local process cannot borrow the client identity through that plaintext port: the
//!   crate authenticates to the bridge with a private auth method and a random 32-byte secret
//!   of the connection, which the bridge checks in constant time on the first frame (it must
//!   be `CONNECT`) before it contacts the broker, and replaces with `auth_method_name = "tls"`.
//!   Anything else is closed and logged at debug (without the secret); the broker never sees
//!   it. The secret is shown only by the pulsar crate's own TRACE log of its `CONNECT`.
//! - Lookup answers (`LOOKUP_RESPONSE`) are rewritten to a bridge listener per broker (its
//!   `brokerServiceUrlTls`), so every broker connection goes through the bridge. Behind a
//!   Pulsar proxy (`proxy_through_service_url`) the crate stays on the service URL and names
//!   the broker's TLS address as `proxy_to_broker_url`, as Java's client does. A lookup answer
//!   without a TLS address fails rather than connect in plaintext.
//! - The cost: every frame crosses the loopback once more and is copied once more through
//!   the process (one extra copy per frame and direction; only lookup, auth-response and
//!   connect commands are decoded, payloads pass byte for byte), and each broker connection
//!   is two sockets. [`PulsarPlatform::mtls_bridge`] shows what the bridge did.
//! - `connect` makes the first connection to the broker itself, before the crate connects:
//!   a refused certificate (the broker does not trust ours: its TLS alert or
//!   `AuthenticationError`; we do not trust the broker's; it does not name the host) is an
//!   [`ErrorKind::Auth`] error naming the server, within milliseconds, and said once (the
//!   crate, never started, logs nothing about it). An unreadable file, a
//!   file without a certificate or key, or a key that is not the certificate's is a `Config`
//!   error naming the files. Key contents never appear in errors, logs or `Debug`.
//! - The bridge outlives the platform that holds it until the crate has closed its
//!   connections (at most 5 s): the crate closes a dropped producer or consumer from a task of
//!   its own, after the platform may be gone, and a bridge that stopped first cut those closes
//!   off (an ERROR line per producer and consumer at the end of every run).
//! - `tls_hostname_verification=false` (Java `tlsHostnameVerificationEnable`: the chain is
//!   still verified, not the name) and `tls_allow_insecure_connection=true` (any
//!   certificate) are taken on this path only, where the TLS is onceflow's. Without a client
//!   certificate the crate's rustls TLS ignores both, so each is an `Unsupported` error rather
//!   than being ignored.
//!
//! ## Topics, partitions, order
//! - A topic `NAME` is `persistent://TENANT/NAMESPACE/NAME` (`tenant`/`namespace` options,
//!   `public/default` by default); `TENANT/NAMESPACE/NAME` is taken as given.
//! - A topic with one partition is a **non-partitioned** topic (onceflow partition 0); with
//!   `N > 1` partitions a **partitioned topic** whose partition `i` is `NAME-partition-i`.
//!   Topics the broker auto-creates are non-partitioned.
//! - **Positions** are message ids ([`onceflow_core::Position::MessageId`]): ledger, entry,
//!   partition index (`-1` for a non-partitioned topic) and batch index (`-1` unbatched).
//! - The record **key** is the message's partition key (Base64 with `partition_key_b64_encoded`
//!   when it is not UTF-8) and its **ordering key** (what `key_shared` dispatches on). A keyed
//!   record goes to partition `murmur3_32(key) % N` (the crate's routing hash; hex of a binary
//!   key), an unkeyed one round-robin, an explicit partition wins.
//! - The record **timestamp** is the message's event time; a message's timestamp is its event
//!   time, else its publish time.
//! - **Headers** are message properties (`traceparent` included, so other clients see the
//!   trace). Properties are UTF-8 strings in a map, so the exact list (order, repeats, null
//!   vs empty, binary values) also travels in `onceflow-headers` (a record without headers
//!   has no properties) and is rebuilt from it;
//!   messages from other clients get their properties as headers in wire order.
//!
//! ## Producer
//! - One crate producer per partition of each topic written to, named
//!   [`PulsarOptions::producer_name`], else `ProducerConfig::client_id`, else a unique name the
//!   broker assigns. Batching (`batch_size`, `batch_bytes`, `batch_timeout_ms`) and compression
//!   (`compression`) are the crate's. `send_batch` hands every record to the crate before
//!   waiting for receipts, so they share batches.
//! - **Transactions** (PIP-31) with `transactions=true` on the URL (Java's
//!   `enableTransaction`; the brokers need `transactionCoordinatorEnabled=true`): a producer
//!   with a transactional id `begin`s a transaction at a transaction coordinator, its sends and
//!   the acknowledgements `commit_offsets` makes are inside it, `commit` / `abort` end it
//!   (`transaction_timeout_ms`, default 60 s, after which the coordinator aborts it). The
//!   pulsar crate has no transactions (streamnative/pulsar-rs#253), so onceflow speaks the
//!   coordinator protocol on connections of its own (`txn.rs`) and the crate's connections go
//!   through onceflow's loopback bridge, which puts the transaction's id on the crate's sends
//!   (command and stored metadata) and acknowledgements and reads the broker's answers to the
//!   latter (`bridge.rs`, [`Capabilities::transactions`] is then true). The pipeline then
//!   writes its outputs and acknowledges its inputs atomically; readers never see an aborted
//!   transaction's messages. `commit` and `abort` (and the background abort of a dropped
//!   transaction) first send what the producer still batches and wait, at most
//!   `operation_timeout_ms`, until every record handed over in the transaction has left for the
//!   broker with its id; one written later still carries it, so it is never delivered, neither
//!   outside a transaction nor in the producer's next one. While a transaction is open, every
//!   send of its producer is part of it (sends from other tasks too, as on Kafka); records sent
//!   outside one, before `begin` or after the transaction ended or was dropped, are never part
//!   of it (`begin` first waits for the earlier ones to leave; a resend after a reconnect keeps
//!   the transaction its first copy had). Differences from Kafka: a transactional id does not fence an
//!   older producer with the same id (Pulsar has no producer epochs; a member that lost a
//!   partition is stopped by its acknowledgements, which conflict with the new member's), and
//!   after an abort the acknowledged messages are held by the member again (a later commit
//!   covers them; the pipeline gets them again through
//!   `Consumer::rewind_uncommitted`, the broker's redelivery, never a seek: a seek resets
//!   the subscription's cursor and undoes acknowledgements past its position, also those of
//!   committed transactions past a message an open transaction holds). By subscription type: on
//!   failover (the default) and exclusive one member reads a partition, and a commit whose
//!   partition moved meanwhile is `Fenced` (checked against the broker's active consumer);
//!   on shared and key_shared every member may receive a message again after a redelivery,
//!   and the second transaction to acknowledge it is refused by the broker
//!   (`TransactionConflict`, whether the first one committed already or is still open) and
//!   aborted (`Aborted`): either way each input's outputs commit once (shown in
//!   `tests/transactions.rs` with a member whose connection is cut while it holds the
//!   message). **Batches** (with batch-index acknowledgement): a transaction's ack set clears
//!   only the messages it acknowledges (the broker refuses one that clears a message another
//!   transaction acknowledged, and a whole-entry acknowledgement of a batch a transaction
//!   acknowledged part of), so transactions may end inside a batch. When a member goes away
//!   (or its partition moves) after a transaction acknowledged part of a batch, the broker
//!   redelivers the entry with an ack set naming what is left (`CommandMessage.ack_set`),
//!   which the pulsar crate ignores; the bridge reads it and the consumer drops the messages
//!   it marks acknowledged, as Java's client does (else the next member got them again and
//!   the broker refused its transactions at that entry every time). Without `transactions=true`, `begin()` is `Unsupported`
//!   and pipelines run **effectively-once**: the dedup store decides whether a message's side
//!   effects ran, and readers of the output skip repeated idempotency keys.
//! - **Broker deduplication and named producers** (PIP-6, `brokerDeduplicationEnabled`): the
//!   broker drops a message whose (producer name, sequence id) it has already stored and
//!   still acknowledges it, with message id `(-1,-1)`. The pulsar crate starts every producer's
//!   sequence ids at 0 and does not take the broker's last sequence id, so a producer whose
//!   name was used before (a restarted process) has its first messages silently dropped
//!   (the `pulsar_dedup` test shows it with the raw crate). With `producer_name` on the URL
//!   (or `transactions=true`) the crate's connections go through onceflow's loopback bridge,
//!   which moves each named producer's sequence ids past the broker's last one for the name
//!   (`PRODUCER_SUCCESS`'s `last_sequence_id`, as Java's client resumes): a restarted named
//!   producer loses and duplicates nothing. Otherwise (a name from `ProducerConfig` on a
//!   connection without the bridge) onceflow turns such a receipt into a `Platform` error
//!   naming the producer instead of a delivery, never a silent success. onceflow does not rely
//!   on broker dedup: `Capabilities::idempotent_producer` is false. Within one
//!   producer's life, the crate's resends after a reconnect keep their sequence ids, so a
//!   broker with dedup on stores them once, and its (-1,-1) answer to a resend of a message
//!   it stored is a delivery with `Delivery::duplicate` set: certain for a broker-assigned
//!   name (the default) and for a named producer once the broker stored a lower sequence id
//!   of it (see `PulsarProducer::complete`). For a named producer with nothing stored yet the
//!   two cases look alike (the crate does not pass on the broker's last sequence id of the
//!   name), so that error has `Error::outcome_unknown` set: the record may be stored.
//! - `max_record_bytes` is `max_message_bytes` (the broker's `maxMessageSize`, 5 MiB) minus
//!   16 KiB for the properties onceflow adds.
//!
//! ## Consumer
//! - A **group is a subscription**; each partition has its own crate consumer, named after the
//!   member (`ConsumerConfig::client_id`, else random). `subscription_type` picks
//!   [`SubscriptionType`]: **failover** (default: one active member per partition, in order;
//!   the broker spreads partitions over the members by name), **exclusive**, **shared**,
//!   **key_shared** (per key, order is kept).
//! - **Assignment (failover)**: every `refresh_ms` the member reads which partitions it is the
//!   active consumer of (`activeConsumerName` in the topic stats). A partition it is no longer
//!   active for is revoked: the listener's `on_revoked` runs, its positions are committed, and
//!   what was fetched is dropped (the broker redelivers it to the new active member). The
//!   broker waits `activeConsumerFailoverDelayTimeMillis` (1 s by default) before it
//!   dispatches to the new member, which leaves the old one time to commit. Shared,
//!   key_shared and exclusive members read every partition.
//! - **commit** individually acknowledges every message of the partition delivered by `poll` up
//!   to the position and not nacked (onceflow's "last finished position" model, as on
//!   JetStream). Like every Pulsar client's acknowledgement it has no broker reply: `commit`
//!   returns once the acks are queued, in order, to the crate consumer, which writes them to
//!   the connection behind the messages the broker pushed before them (at most
//!   `receiver_queue_size`, which is also the crate's flow permits); `close` sends every
//!   queued ack and then closes the consumer, in that order on the connection. See
//!   `PulsarConsumer::commit` for the sources.
//! - **Batches** (a producer's `batch_size`): one ledger entry holds several messages, and an
//!   acknowledgement without an ack set acknowledges the whole entry. Where the broker has
//!   batch-index acknowledgement on (`acknowledgmentAtBatchIndexLevelEnabled`, PIP-54; read at
//!   connect, shown as [`onceflow_core::Capabilities::batch_index_ack`]) each message is
//!   acknowledged with an ack set; otherwise (or with `batch_index_ack=off`) the
//!   acknowledgements of a batch are held until every message of it is settled, then the entry
//!   is acknowledged once. A message whose batch sibling is nacked or still in progress is
//!   therefore never acknowledged with it; a batch left partly settled (member closed,
//!   partition moved) is redelivered whole or, with ack sets, with its settled messages again
//!   (the crate does not filter them; with `transactions=true` the bridge reads the broker's
//!   ack set and onceflow drops them): at-least-once, the dedup store skips them.
//! - **Redeliveries** reach the application, except a message it holds (delivered, neither
//!   committed nor nacked) and a settled message of a batch whose acknowledgement onceflow
//!   still holds: after a connection reset the broker redelivers what it has no
//!   acknowledgement for, which may include messages committed just before (the pulsar crate
//!   drops acknowledgements it could not write), and those must be committed again.
//! - **nack** is a negative ack sent after the delay. Shared / key_shared redeliver that
//!   message ([`onceflow_core::Capabilities::per_message_nack`]); failover / exclusive
//!   redeliver every unacked message of the partition in order, so onceflow rewinds: it drops
//!   what it fetches until the nacked message is back.
//! - **Dead letters**: `dead_letter=<topic>&max_redeliver=N` sets the crate's dead-letter
//!   policy: a message redelivered N times goes to that topic and is acknowledged. The broker
//!   counts redeliveries only on shared and key_shared subscriptions.
//! - **Replay**: `seek` / an explicit start resets the subscription's cursor by message id
//!   (the rest of a batch before it is skipped), to the earliest or latest message, or by
//!   time: the broker seeks by publish time and onceflow skips (and acknowledges) messages
//!   whose time (event time) is still earlier.
//! - **committed** is known locally after a commit (the next delivered, uncommitted message);
//!   otherwise it is read from the cursor (`markDeletePosition` in the internal stats): `None`
//!   before the first entry, else the next entry of that ledger.
//! - **lag** is the subscription's `msgBacklog` (admin REST topic stats); `group_lag` reads it
//!   without connecting a consumer.
//! - `Message::delivery_count` counts deliveries to this member (the crate does not expose the
//!   broker's redelivery count).
//!
//! ## Admin
//! Create (non-partitioned for one partition, partitioned otherwise; retention as the topic's
//! retention policy, minutes and MiB rounded up), describe, delete, through the admin REST API.
//! Compaction is not offered.
//!
//! [pulsar]: https://docs.rs/pulsar

mod admin;
mod auth;
mod bridge;
mod config;
mod consumer;
mod convert;
mod producer;
mod transaction;
mod txn;
mod wire;

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use onceflow_core::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, PlatformBackend,
    ProducerBackend, ProducerConfig, Result,
};
use parking_lot::Mutex;
use pulsar::{Pulsar, TokioExecutor};

pub use admin::PulsarAdmin;
pub use bridge::BridgeStats;
pub use config::{
    parse_url, BatchIndexAck, CompressionKind, OAuth2Options, PulsarAuth, PulsarOptions,
    SubscriptionType, TlsClientCert,
};
pub use consumer::PulsarConsumer;
pub use convert::HEADERS_PROPERTY;
pub use producer::{producer_options, PulsarProducer};

use admin::{Rest, TopicShape};
use auth::Credentials;

/// Bytes of the broker's message size kept for the properties onceflow adds.
pub(crate) const PROPERTY_ROOM: usize = 16 * 1024;

/// What Pulsar can do through this adapter with the default (failover) subscription.
pub const CAPABILITIES: Capabilities = Capabilities {
    transactions: false,
    idempotent_producer: false,
    dedup_by_id: false,
    atomic_batch: false,
    native_headers: true,
    consumer_groups: true,
    seek_by_timestamp: true,
    pause_resume: true,
    per_message_nack: false,
    compaction: false,
    lag_ms: false,
    batch_index_ack: false,
};

/// Capabilities with these options, not knowing the broker: shared and key_shared
/// subscriptions redeliver one nacked message; `batch_index_ack` is false (see
/// [`capabilities_on`]).
pub fn capabilities(options: &PulsarOptions) -> Capabilities {
    capabilities_on(options, false)
}

/// Capabilities with these options on a broker that has batch-index acknowledgement on
/// (`broker_batch_index_ack`, PIP-54) or not: `batch_index_ack` is true when both the broker
/// and [`PulsarOptions::batch_index_ack`] allow it.
pub fn capabilities_on(options: &PulsarOptions, broker_batch_index_ack: bool) -> Capabilities {
    Capabilities {
        transactions: options.transactions,
        per_message_nack: !options.subscription_type.single_active(),
        batch_index_ack: broker_batch_index_ack && options.batch_index_ack == BatchIndexAck::Auto,
        ..CAPABILITIES
    }
}

/// Connects to the broker named in `url` (see the crate docs).
pub async fn connect(url: &str) -> Result<Arc<PulsarPlatform>> {
    PulsarPlatform::connect(url).await
}

/// State shared by the producers, consumers and admin handle of one connection.
pub(crate) struct Shared {
    pub(crate) client: Pulsar<TokioExecutor>,
    pub(crate) options: PulsarOptions,
    pub(crate) rest: Rest,
    /// The broker has `acknowledgmentAtBatchIndexLevelEnabled` on (PIP-54), read at connect.
    pub(crate) broker_batch_index_ack: bool,
    topics: Mutex<HashMap<String, TopicShape>>,
    /// The mTLS loopback bridge, with a client certificate (stops when dropped, after the
    /// client above).
    bridge: Option<bridge::Bridge>,
    /// How onceflow's own broker connections connect (transactions, `txn.rs`).
    wire: wire::WireConfig,
    /// The cluster's transaction coordinators, found on first use.
    coordinators: tokio::sync::OnceCell<Arc<txn::Coordinators>>,
    /// With `transactions=true`: the transactions the bridge puts on the crate's frames.
    pub(crate) txn_frames: Option<Arc<bridge::TxnFrames>>,
}

impl Shared {
    /// Capabilities of a producer or consumer with `options` on this broker.
    pub(crate) fn capabilities(&self, options: &PulsarOptions) -> Capabilities {
        capabilities_on(options, self.broker_batch_index_ack)
    }

    pub(crate) fn max_record_bytes(&self, options: &PulsarOptions) -> usize {
        options.max_message_bytes.saturating_sub(PROPERTY_ROOM)
    }

    /// The cluster's transaction coordinators (found, and connected to, on first use).
    /// `Unsupported` when the cluster has none.
    pub(crate) async fn coordinators(&self) -> Result<Arc<txn::Coordinators>> {
        self.coordinators
            .get_or_try_init(|| async {
                let service =
                    wire::BrokerAddr::of_url(&self.options.service_url).ok_or_else(|| {
                        Error::config(format!(
                            "{}: no broker address for transactions",
                            onceflow_core::redact_credentials(&self.options.service_url)
                        ))
                    })?;
                txn::Coordinators::discover(self.wire.clone(), service)
                    .await
                    .map(Arc::new)
            })
            .await
            .cloned()
    }

    pub(crate) fn forget_topic(&self, topic: &str) {
        self.topics.lock().remove(topic);
    }

    /// Shape of `topic` (cached once it exists).
    pub(crate) async fn shape(&self, topic: &str) -> Result<TopicShape> {
        if let Some(s) = self.topics.lock().get(topic) {
            return Ok(*s);
        }
        let s = self.rest.shape(&self.options.admin_path(topic)).await?;
        if s != TopicShape::Missing {
            self.topics.lock().insert(topic.to_string(), s);
        }
        Ok(s)
    }
}

/// The longest wait for the client's connection handshake in [`PulsarPlatform::connect_with`].
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The `HOST:PORT`s of a `pulsar://` or `pulsar+ssl://` service URL (credentials and path
/// left out); empty when the URL has another shape.
fn service_hosts(url: &str) -> Vec<&str> {
    let Some(rest) = url
        .strip_prefix("pulsar://")
        .or_else(|| url.strip_prefix("pulsar+ssl://"))
    else {
        return Vec::new();
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts)
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect()
}

/// A connection to a Pulsar cluster: the factory of producers, consumers and the admin handle.
pub struct PulsarPlatform {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PulsarPlatform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarPlatform")
            .field("service_url", &self.shared.options.service_url)
            .field("admin_url", &self.shared.options.admin_url)
            .finish()
    }
}

impl PulsarPlatform {
    /// Connects to `url` (`pulsar://host:port?…` or `pulsar+ssl://host:port?…`). `Config` for
    /// a bad URL or an unreadable CA / token / OAuth2 key file, `Connect` when the broker or
    /// its admin API cannot be reached, `Auth` when a certificate or credential is refused.
    pub async fn connect(url: &str) -> Result<Arc<PulsarPlatform>> {
        Self::connect_with(parse_url(url)?).await
    }

    /// Connects with typed options.
    ///
    /// The pulsar crate retries a refused connection for about 40 s, and waits much longer on
    /// a port that accepts connections but does not speak Pulsar; so the brokers of the service
    /// URL are first tried with a TCP connection (5 s each,
    /// [`onceflow_core::net::check_reachable`]), and the client's handshake is bounded by
    /// `operation_timeout_ms` (at most 10 s).
    pub async fn connect_with(options: PulsarOptions) -> Result<Arc<PulsarPlatform>> {
        options.validate()?;
        let service = onceflow_core::redact_credentials(&options.service_url);
        let tls = options.service_url.starts_with("pulsar+ssl://");
        let trusted = match &options.tls_trust_certs {
            Some(path) => Some(auth::trusted_pem(path)?),
            None => None,
        };
        let credentials = Credentials::of(&options)?;
        let servers = service_hosts(&options.service_url);
        if !servers.is_empty() {
            onceflow_core::net::check_reachable(
                "Pulsar",
                &servers,
                onceflow_core::net::REACH_TIMEOUT,
            )
            .await?;
        }
        auth::ensure_crypto_provider();
        // A client certificate: the crate talks to the loopback bridge, which makes the TLS
        // connections (see bridge.rs); so it does with transactions, whose ids the bridge puts
        // on the crate's sends and acknowledgements.
        let mtls = match &options.auth {
            config::PulsarAuth::Tls(cert) => Some(bridge::client_config(
                cert,
                trusted.as_deref(),
                options.tls_hostname_verification,
                options.tls_allow_insecure_connection,
            )?),
            _ => None,
        };
        let tls_config = match (&mtls, tls) {
            (Some(c), _) => Some(Arc::new(c.clone())),
            (None, true) => Some(Arc::new(auth::tls_config(trusted.as_deref())?)),
            (None, false) => None,
        };
        // The bridge also moves named producers' sequence ids past what the broker stored
        // (see bridge.rs, `TxnFrames`): with transactions, and with a producer name.
        let frames_on = options.transactions || options.producer_name.is_some();
        let txn_frames = frames_on.then(|| Arc::new(bridge::TxnFrames::new(options.transactions)));
        // What the bridge and onceflow's own connections present to the brokers.
        let present = match &options.auth {
            config::PulsarAuth::Tls(cert) => {
                bridge::Present::ClientCert(cert.cert_file.display().to_string())
            }
            _ => bridge::Present::Credentials(credentials.clone(), Credentials::describe(&options)),
        };
        let bridge = if mtls.is_some() || frames_on {
            let upstream =
                bridge::Upstream::of_url(&options.service_url, tls).ok_or_else(|| {
                    Error::config(format!(
                        "{service}: {} needs {}://host:port",
                        if mtls.is_some() {
                            "a client certificate"
                        } else {
                            "transactions=true or producer_name"
                        },
                        if tls { "pulsar+ssl" } else { "pulsar" }
                    ))
                })?;
            let b = bridge::Bridge::start(
                upstream,
                tls_config.clone(),
                present.clone(),
                txn_frames.clone(),
                options.operation_timeout.min(HANDSHAKE_TIMEOUT),
            )?;
            // A refused certificate or credential is found here, before the crate connects:
            // the crate would log its own ERROR for it, and onceflow's error would say it again.
            b.check().await?;
            Some(b)
        } else {
            None
        };
        let service_url = match &bridge {
            Some(b) => b.local_url(),
            None => options.service_url.clone(),
        };
        let mut builder = Pulsar::builder(service_url, TokioExecutor)
            .with_operation_retry_options(pulsar::OperationRetryOptions {
                operation_timeout: options.operation_timeout,
                ..Default::default()
            })
            .with_connection_retry_options(pulsar::ConnectionRetryOptions {
                max_retries: options.connection_max_retries,
                max_backoff: options.connection_max_backoff,
                ..Default::default()
            });
        if tls && bridge.is_none() {
            if let Some(pem) = &trusted {
                builder = builder.with_certificate_chain(pem.clone());
            }
        }
        builder = match (&bridge, &credentials) {
            (Some(b), _) => builder.with_auth(b.authentication()),
            (None, Credentials::None | Credentials::ClientCert) => builder,
            (None, Credentials::Token(t)) => builder.with_auth(pulsar::Authentication {
                name: "token".to_string(),
                data: t.clone().into_bytes(),
            }),
            (None, Credentials::Provider(p)) => builder.with_auth_provider(Box::new(p.clone())),
        };
        let handshake = options.operation_timeout.min(HANDSHAKE_TIMEOUT);
        let built = tokio::time::timeout(handshake, builder.build()).await;
        let client = match built {
            Ok(Ok(client)) => client,
            failed => {
                // Through the bridge, it saw what the broker refused.
                if let Some(e) = bridge.as_ref().and_then(bridge::Bridge::take_refusal) {
                    return Err(e);
                }
                // The crate folds a refused TLS handshake or credential into one "fatal
                // error": connect once more to tell which step the server refused.
                if bridge.is_none() {
                    if let Some(e) =
                        auth::diagnose(&options, &credentials, trusted.as_deref()).await
                    {
                        return Err(e);
                    }
                }
                return Err(match failed {
                    Err(_) => Error::new(
                        ErrorKind::Connect,
                        format!(
                            "no Pulsar broker at {service} completed the connection handshake \
                             within {} ms; the port accepts connections: is it the broker's \
                             binary protocol port (6650, or 6651 for pulsar+ssl://), not the \
                             HTTP admin port?",
                            handshake.as_millis()
                        ),
                    ),
                    Ok(Err(e)) => {
                        let kind = match &e {
                            pulsar::Error::Connection(
                                pulsar::error::ConnectionError::Authentication(_),
                            ) => ErrorKind::Auth,
                            _ => ErrorKind::Connect,
                        };
                        let text = auth::scrub(&e.to_string(), &options);
                        Error::new(
                            kind,
                            format!("cannot connect to Pulsar at {service}: {text}"),
                        )
                    }
                    Ok(Ok(_)) => unreachable!("handled above"),
                });
            }
        };
        let wire = wire::WireConfig {
            tls: tls_config,
            present,
            timeout: options.operation_timeout,
        };
        let rest = Rest::new(
            &options.admin_url,
            options.operation_timeout,
            trusted.as_deref(),
            mtls,
            credentials,
        )?;
        // The admin API answers (lag, partitions and assignment need it).
        rest.shape("public/default/onceflow-connect-check")
            .await
            .map_err(|e| {
                if e.kind() == ErrorKind::Auth {
                    return e;
                }
                Error::new(
                    ErrorKind::Connect,
                    format!(
                        "the Pulsar admin API at {} does not answer (set admin=http://host:port \
                         or admin=https://host:port): {}",
                        onceflow_core::redact_credentials(&options.admin_url),
                        e.message()
                    ),
                )
                .with_source(e)
            })?;
        let broker_batch_index_ack = match rest.batch_index_ack().await {
            Ok(on) => on,
            Err(e) => {
                tracing::debug!(
                    error = %e,
                    "cannot read whether the broker acknowledges single messages of a batch \
                     (PIP-54); the acknowledgements of a batch are held until all its messages \
                     are settled"
                );
                false
            }
        };
        Ok(Arc::new(PulsarPlatform {
            shared: Arc::new(Shared {
                client,
                options,
                rest,
                broker_batch_index_ack,
                topics: Mutex::new(HashMap::new()),
                bridge,
                wire,
                coordinators: tokio::sync::OnceCell::new(),
                txn_frames,
            }),
        }))
    }

    /// The connection's options.
    pub fn options(&self) -> &PulsarOptions {
        &self.shared.options
    }

    /// What the mTLS loopback bridge did (its listeners, the local connections it relayed and
    /// those it closed without contacting a broker); `None` without a client certificate.
    /// For diagnostics: see the crate docs, "TLS client certificates".
    pub fn mtls_bridge(&self) -> Option<BridgeStats> {
        self.shared.bridge.as_ref().map(bridge::Bridge::stats)
    }

    /// The pulsar crate client, for anything onceflow does not cover. With a client
    /// certificate its connections go through this platform's mTLS bridge, which stops when
    /// the platform (and every producer, consumer and admin handle of it) is dropped.
    pub fn pulsar_client(&self) -> Pulsar<TokioExecutor> {
        self.shared.client.clone()
    }
}

#[async_trait]
impl PlatformBackend for PulsarPlatform {
    fn name(&self) -> &'static str {
        "pulsar"
    }

    fn capabilities(&self) -> Capabilities {
        self.shared.capabilities(&self.shared.options)
    }

    async fn producer(&self, config: ProducerConfig) -> Result<Arc<dyn ProducerBackend>> {
        Ok(Arc::new(PulsarProducer::new(self.shared.clone(), config)?))
    }

    async fn consumer(&self, config: ConsumerConfig) -> Result<Arc<dyn ConsumerBackend>> {
        Ok(PulsarConsumer::join(self.shared.clone(), config).await?)
    }

    async fn admin(&self) -> Result<Arc<dyn AdminBackend>> {
        Ok(Arc::new(PulsarAdmin {
            shared: self.shared.clone(),
        }))
    }

    fn max_record_bytes(&self) -> usize {
        self.shared.max_record_bytes(&self.shared.options)
    }

    fn max_record_bytes_source(&self) -> Option<&'static str> {
        Some("max_message_bytes on the pulsar:// URL, the broker's maxMessageSize, less 16 KiB for onceflow's properties")
    }
}

/// This adapter's entry in the backend registry (`onceflow_core::registry`): the schemes
/// `pulsar://`, `pulsar+ssl://` and how to connect, [`connect`]; `pulsar+ssl://` is Pulsar over TLS. The `onceflow` facade lists it.
pub const PLATFORM: onceflow_core::registry::PlatformEntry =
    onceflow_core::registry::PlatformEntry {
        name: "pulsar",
        schemes: &["pulsar://", "pulsar+ssl://"],
        connect: |url, _| {
            onceflow_core::registry::boxed(async move {
                Ok(onceflow_core::registry::client(connect(&url).await?))
            })
        },
    };

#[cfg(test)]
mod tests {
    use super::service_hosts;

    #[test]
    fn service_hosts_leave_out_credentials_and_path() {
        assert_eq!(
            service_hosts("pulsar://u:p@a:6650,b:6650/x?y=1"),
            vec!["a:6650", "b:6650"]
        );
        assert_eq!(service_hosts("pulsar+ssl://h:6651"), vec!["h:6651"]);
        assert!(service_hosts("http://h:8080").is_empty());
    }
}
