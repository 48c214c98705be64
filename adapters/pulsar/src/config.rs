//! `pulsar://` and `pulsar+ssl://` URL parsing and the typed options of the adapter.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use onceflow_core::{Error, Result};

/// Pulsar subscription type of a consumer group
/// (<https://pulsar.apache.org/docs/next/concepts-messaging/#subscription-types>).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SubscriptionType {
    /// `failover` (default): one active consumer per partition, the others stand by; per
    /// partition order is kept. The broker spreads partitions over the members by name.
    #[default]
    Failover,
    /// `exclusive`: one consumer for the whole subscription; a second one is refused.
    Exclusive,
    /// `shared`: messages spread round-robin over the members; no order.
    Shared,
    /// `key_shared`: messages spread by key; per key, order is kept.
    KeyShared,
}

impl SubscriptionType {
    /// Whether one member at a time reads a partition (failover, exclusive): a negative ack
    /// rewinds the partition there, since the broker redelivers every unacked message to keep
    /// the order.
    pub fn single_active(self) -> bool {
        matches!(
            self,
            SubscriptionType::Failover | SubscriptionType::Exclusive
        )
    }

    /// The name `subscription_type=` takes: `failover`, `exclusive`, `shared`, `key_shared`.
    pub fn name(self) -> &'static str {
        match self {
            SubscriptionType::Failover => "failover",
            SubscriptionType::Exclusive => "exclusive",
            SubscriptionType::Shared => "shared",
            SubscriptionType::KeyShared => "key_shared",
        }
    }

    fn parse(key: &str, value: &str) -> Result<Self> {
        Ok(
            match value.to_ascii_lowercase().replace('-', "_").as_str() {
                "failover" => SubscriptionType::Failover,
                "exclusive" => SubscriptionType::Exclusive,
                "shared" => SubscriptionType::Shared,
                "key_shared" | "keyshared" => SubscriptionType::KeyShared,
                _ => {
                    return Err(Error::config(format!(
                        "'{key}={value}': expected failover, exclusive, shared or key_shared"
                    )))
                }
            },
        )
    }
}

/// How a consumer acknowledges the messages of a batch (`batch_index_ack=`).
///
/// A batch is one entry of the topic's ledger holding several messages. An acknowledgement
/// without an ack set acknowledges the whole entry at the broker, every message of the batch;
/// batch-index acknowledgement (PIP-54,
/// <https://github.com/apache/pulsar/wiki/PIP-54:-Support-acknowledgment-at-batch-index-level>)
/// sends an ack set (a bit set over the batch, 1 for each message still unacknowledged) and
/// acknowledges single messages, where the broker has `acknowledgmentAtBatchIndexLevelEnabled`
/// on (off by default in Pulsar). Either way onceflow never acknowledges a message of a batch
/// in a way that also acknowledges a sibling the application has not settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchIndexAck {
    /// `auto` (default): batch-index acknowledgement when the broker has it on (read from the
    /// admin API at connect, `GET /admin/v2/brokers/configuration/runtime`, key
    /// `acknowledgmentAtBatchIndexLevelEnabled`), else as `off`. A broker whose configuration
    /// cannot be read counts as off.
    #[default]
    Auto,
    /// `off`: the acknowledgements of a batch's messages are held until every message of the
    /// batch is settled (committed, or skipped after a seek), then the whole entry is
    /// acknowledged at once. A member that closes or loses the partition before that leaves the
    /// entry to be redelivered whole (at-least-once: the dedup store skips the finished ones).
    Off,
}

/// Producer compression (`compression=`), done by the pulsar crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompressionKind {
    /// `none` (default).
    #[default]
    None,
    /// `lz4`.
    Lz4,
    /// `zlib`.
    Zlib,
    /// `zstd`.
    Zstd,
    /// `snappy`.
    Snappy,
}

/// How the client authenticates to the broker and the admin REST API (Pulsar's
/// `authPlugin` / `authParams`, <https://pulsar.apache.org/docs/next/security-overview/>).
///
/// `Debug` never shows a token: `Token(***)`.
#[derive(Clone, PartialEq, Eq, Default)]
pub enum PulsarAuth {
    /// No credentials (the broker's `anonymousUserRole`, if it has one).
    #[default]
    None,
    /// `token=JWT`: a token string (Java's `AuthenticationToken` with `token:…`), sent as the
    /// `token` auth method and as `Authorization: Bearer` to the admin API.
    Token(String),
    /// `token_file=/path`: a file holding the token (Java's `AuthenticationToken` with
    /// `file:///path`). Surrounding whitespace is ignored. The file is read again whenever its
    /// modification time or length changed, at each (re)connection, each broker auth challenge
    /// (token refresh, `authenticationRefreshCheckSeconds`) and each admin call, so a rotated
    /// token is picked up without a restart.
    TokenFile(PathBuf),
    /// OAuth2 client credentials (Java's `AuthenticationOAuth2`, type `client_credentials`),
    /// done by the pulsar crate's `OAuth2Authentication`: the token endpoint is discovered
    /// from `{issuer_url}/.well-known/openid-configuration`, an access token fetched with the
    /// client id and secret from the credentials file and renewed before it expires.
    OAuth2(OAuth2Options),
    /// `tls_cert_file=/path/client.pem&tls_key_file=/path/client.key`: a TLS client
    /// certificate (mTLS; Java's `AuthenticationTls` with `tlsCertFile` / `tlsKeyFile`, the
    /// broker's `AuthenticationProviderTls` takes the role from the certificate's common
    /// name). Needs `pulsar+ssl://`. The pulsar crate cannot present a client certificate, so
    /// the connection goes through onceflow's in-process loopback bridge (see the crate docs,
    /// "TLS client certificates"). Both files are read once, at connect.
    Tls(TlsClientCert),
}

/// The client certificate of [`PulsarAuth::Tls`]: PEM files (paths, or `file://` URLs).
/// Pulsar docs: "Authentication using TLS"
/// (<https://pulsar.apache.org/docs/next/security-tls-authentication/>).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsClientCert {
    /// `tls_cert_file` (Java `tlsCertFile`): the client certificate, then any intermediate
    /// CA certificates, PEM (`-----BEGIN CERTIFICATE-----`).
    pub cert_file: PathBuf,
    /// `tls_key_file` (Java `tlsKeyFile`): its private key, PEM: PKCS#8
    /// (`BEGIN PRIVATE KEY`), PKCS#1 (`BEGIN RSA PRIVATE KEY`) or SEC1
    /// (`BEGIN EC PRIVATE KEY`), unencrypted. Its content never appears in an error, a log
    /// line or `Debug` output.
    pub key_file: PathBuf,
}

impl std::fmt::Debug for PulsarAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PulsarAuth::None => f.write_str("None"),
            PulsarAuth::Token(_) => f.write_str("Token(***)"),
            PulsarAuth::TokenFile(p) => f.debug_tuple("TokenFile").field(p).finish(),
            PulsarAuth::OAuth2(o) => f.debug_tuple("OAuth2").field(o).finish(),
            PulsarAuth::Tls(c) => f.debug_tuple("Tls").field(c).finish(),
        }
    }
}

/// OAuth2 client-credentials options (`oauth2_*` URL keys). Pulsar's Java names are in
/// brackets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OAuth2Options {
    /// `oauth2_issuer_url` (`issuerUrl`): the authorization server; its token endpoint is read
    /// from `{issuer_url}/.well-known/openid-configuration`. The crate's HTTP client trusts the
    /// public web PKI (webpki roots) only: an issuer behind a private CA is not reachable,
    /// `tls_trust_certs` does not apply to it.
    pub issuer_url: String,
    /// `oauth2_credentials_file` (`privateKey`): path (or `file://` URL) of the JSON key file,
    /// `{"client_id": "…", "client_secret": "…"}` (optionally `"issuer_url"`).
    pub credentials_file: PathBuf,
    /// `oauth2_audience` (`audience`): sent as the `audience` parameter when set.
    pub audience: Option<String>,
    /// `oauth2_scope` (`scope`): requested scope when set.
    pub scope: Option<String>,
}

/// Options of a `pulsar://host:port?key=value&…` connection. Every key is listed here; an
/// unknown key is a [`onceflow_core::ErrorKind::Config`] error naming it. The consumer keys may
/// also be given per consumer in [`onceflow_core::ConsumerConfig::options`], the producer keys
/// per producer in [`onceflow_core::ProducerConfig::options`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulsarOptions {
    /// Broker service URL handed to the pulsar crate (`pulsar://host:port`).
    pub service_url: String,
    /// `admin` (default `http://<host>:8080`): base URL of the admin REST API (topics,
    /// partitions, retention, backlog).
    pub admin_url: String,
    /// `tenant` (default `public`) and `namespace` (default `default`) of plain topic names.
    pub tenant: String,
    /// See `tenant`.
    pub namespace: String,
    /// `operation_timeout_ms` (default 30000, 1 to 3 600 000): how long a send, a lookup or a subscribe may
    /// take (the crate's operation timeout, like Java's `sendTimeout`).
    pub operation_timeout: Duration,
    /// `connection_max_retries` (default 12, the pulsar crate's `ConnectionRetryOptions`):
    /// how often the client retries a broker connection that failed, with a backoff doubling
    /// from 10 ms up to `connection_max_backoff_ms`, before an operation on it fails. A
    /// consumer whose connection stays down past that resubscribes on its own, and its
    /// `poll` reports a retriable `Connect` error for each failed attempt.
    pub connection_max_retries: u32,
    /// `connection_max_backoff_ms` (default 30000, at least 10): the longest wait between two
    /// connection retries (see `connection_max_retries`).
    pub connection_max_backoff: Duration,
    /// `batch_size` (default none = no batching): messages per batch.
    pub batch_size: Option<u32>,
    /// `batch_bytes` (default none): bytes per batch.
    pub batch_bytes: Option<usize>,
    /// `batch_timeout_ms` (default none): a batch is sent at the latest this long after its
    /// first message.
    pub batch_timeout: Option<Duration>,
    /// `compression` (`none` default, `lz4`, `zlib`, `zstd`, `snappy`).
    pub compression: CompressionKind,
    /// `producer_name`: name of every producer of this connection (else the
    /// [`onceflow_core::ProducerConfig::client_id`], else a broker-assigned unique one). See
    /// the crate docs: a name reused after a restart has its messages dropped by broker
    /// dedup, which onceflow reports as errors.
    pub producer_name: Option<String>,
    /// `max_message_bytes` (default 5242880, the broker's `maxMessageSize`): largest message;
    /// onceflow keeps 16 KiB of it for the properties it adds.
    pub max_message_bytes: usize,
    /// `subscription_type` (default `failover`).
    pub subscription_type: SubscriptionType,
    /// `receiver_queue_size` (default 1000): messages the broker may push ahead per partition.
    pub receiver_queue_size: u32,
    /// `ack_timeout_ms` (default none): a delivered message not acked for this long is
    /// redelivered (the crate's unacked-message redelivery).
    pub ack_timeout: Option<Duration>,
    /// `dead_letter` (default none): dead-letter topic; with `max_redeliver` the crate moves a
    /// message redelivered that many times there and acks it (shared and key_shared
    /// subscriptions: only their dispatchers count redeliveries).
    pub dead_letter: Option<String>,
    /// `max_redeliver` (default 0 = off): redeliveries before a message is dead-lettered.
    pub max_redeliver: usize,
    /// `batch_index_ack` (`auto` default, `off`): see [`BatchIndexAck`].
    pub batch_index_ack: BatchIndexAck,
    /// `refresh_ms` (default 250): how often a failover member reads which partitions it is
    /// active for (admin REST topic stats). The broker's `activeConsumerFailoverDelayTimeMillis`
    /// (default 1000) must be longer, so a member commits before its partitions move.
    pub refresh: Duration,
    /// `metadata.KEY=VALUE`: producer and consumer metadata passed verbatim to the broker
    /// (shown in topic stats).
    pub metadata: BTreeMap<String, String>,
    /// `tls_trust_certs=/path/ca.pem` (Java `tlsTrustCertsFilePath`): PEM file of the CA
    /// certificates that sign the broker's and the admin API's certificates, trusted for
    /// `pulsar+ssl://` and an `https://` admin URL in addition to the public web PKI
    /// (webpki roots). The server's name (the URL's host, a DNS name or an IP address) is
    /// always verified against its certificate (`tls_hostname_verification`, Java
    /// `tlsHostnameVerificationEnable`, is `true` and cannot be turned off with the crate's
    /// rustls TLS; with a client certificate, where onceflow makes the TLS connection, see
    /// [`PulsarOptions::tls_hostname_verification`]).
    pub tls_trust_certs: Option<PathBuf>,
    /// `tls_hostname_verification` (default `true`; Java `tlsHostnameVerificationEnable`):
    /// whether the broker's certificate must name the host connected to. `false` is only
    /// taken with a client certificate ([`PulsarAuth::Tls`]), whose TLS connection onceflow
    /// makes itself; the pulsar crate's own TLS ignores the flag, so elsewhere `false` is an
    /// `Unsupported` error. The chain is still verified against the trusted CAs.
    pub tls_hostname_verification: bool,
    /// `tls_allow_insecure_connection` (default `false`; Java `tlsAllowInsecureConnection`):
    /// trust any broker certificate (no chain or name check: anyone on the path can pose as
    /// the broker). As `tls_hostname_verification`, only with a client certificate.
    pub tls_allow_insecure_connection: bool,
    /// How the client authenticates: `token`, `token_file`, the `oauth2_*` keys or a client
    /// certificate (`tls_cert_file` + `tls_key_file`), at most one. See [`PulsarAuth`].
    pub auth: PulsarAuth,
    /// `transactions` (default `false`; see the crate docs, "Transactions"; Java's
    /// `PulsarClientBuilder.enableTransaction`):
    /// producers with a transactional id can `begin` transactions (PIP-31) and the
    /// exactly-once pipeline writes its outputs and acknowledges its inputs in them. The
    /// connection's producers and consumers then reach the brokers through onceflow's
    /// loopback bridge (one more loopback hop per frame), which puts the transaction id on
    /// their sends and acknowledgements; see the crate docs, "Transactions".
    pub transactions: bool,
    /// `transaction_timeout_ms` (default 60000, 1000 to 3 600 000; Java's
    /// `newTransaction().withTransactionTimeout`): a transaction still open this long after
    /// `begin` is aborted by its coordinator, and its commit fails with `Aborted`. It is also
    /// how long readers of a crashed process's output partitions wait: the broker delivers
    /// nothing past a transaction still open there (its max read position), committed
    /// messages of others included, until the coordinator aborts it (960 committed outputs
    /// seen 60.2 s after a SIGKILL with the default, 9.1 s with 5000). A pipeline that
    /// commits every 100 ms does well with a few seconds.
    pub transaction_timeout: Duration,
}

impl Default for PulsarOptions {
    fn default() -> Self {
        PulsarOptions {
            service_url: "pulsar://127.0.0.1:6650".to_string(),
            admin_url: "http://127.0.0.1:8080".to_string(),
            tenant: "public".to_string(),
            namespace: "default".to_string(),
            operation_timeout: Duration::from_secs(30),
            connection_max_retries: 12,
            connection_max_backoff: Duration::from_secs(30),
            batch_size: None,
            batch_bytes: None,
            batch_timeout: None,
            compression: CompressionKind::None,
            producer_name: None,
            max_message_bytes: 5 * 1024 * 1024,
            subscription_type: SubscriptionType::Failover,
            receiver_queue_size: 1000,
            ack_timeout: None,
            dead_letter: None,
            max_redeliver: 0,
            batch_index_ack: BatchIndexAck::Auto,
            refresh: Duration::from_millis(250),
            metadata: BTreeMap::new(),
            tls_trust_certs: None,
            tls_hostname_verification: true,
            tls_allow_insecure_connection: false,
            transactions: false,
            transaction_timeout: Duration::from_secs(60),
            auth: PulsarAuth::None,
        }
    }
}

fn parse_num<T: std::str::FromStr>(key: &str, value: &str, what: &str) -> Result<T> {
    value
        .parse::<T>()
        .map_err(|_| Error::config(format!("'{key}={value}': expected {what}")))
}

/// Largest `operation_timeout_ms`: one hour (an operation bounded by more bounds nothing a
/// caller waits for; a zero bound would fail every operation before it starts).
const MAX_OPERATION_TIMEOUT: Duration = Duration::from_secs(3600);

/// The keys that configure the connection itself (TLS, credentials, connection retries),
/// refused per consumer or producer.
const CONNECTION_KEYS: &[&str] = &[
    "connection_max_retries",
    "connection_max_backoff_ms",
    "tls_trust_certs",
    "tls_hostname_verification",
    "tls_allow_insecure_connection",
    "tls_cert_file",
    "tls_key_file",
    "token",
    "token_file",
];

/// A path given as `/path` or `file:///path`.
fn file_path(value: &str) -> PathBuf {
    match value.strip_prefix("file://") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(value),
    }
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value.to_ascii_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(Error::config(format!(
            "'{key}={}': expected true or false",
            onceflow_core::shown(value)
        ))),
    }
}

fn ms(key: &str, value: &str) -> Result<Duration> {
    parse_num::<u64>(key, value, "a duration in milliseconds").map(Duration::from_millis)
}

/// Checks a topic name: `name`, `tenant/namespace/name` or the full
/// `persistent://tenant/namespace/name`, out of letters, digits and `-_.=:`.
/// `non-persistent://` topics are refused: their messages are neither stored nor redelivered,
/// so no guarantee holds on them.
pub(crate) fn check_topic(topic: &str) -> Result<()> {
    if topic.starts_with("non-persistent://") {
        return Err(Error::unsupported(format!(
            "topic '{}' is non-persistent: Pulsar neither stores nor redelivers its messages, \
             so onceflow cannot consume it exactly once; use a persistent:// topic",
            onceflow_core::shown(topic)
        )));
    }
    let (topic, full) = match topic.strip_prefix("persistent://") {
        Some(rest) => (rest, true),
        None => (topic, false),
    };
    let ok = !topic.is_empty()
        && (!full || topic.split('/').count() == 3)
        && topic.split('/').count() <= 3
        && topic.split('/').all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.=:".contains(c))
        });
    if ok {
        Ok(())
    } else {
        Err(Error::config(format!(
            "topic name '{}' is not valid on Pulsar: expected NAME, TENANT/NAMESPACE/NAME or \
             persistent://TENANT/NAMESPACE/NAME out of letters, digits and -_.=:",
            onceflow_core::shown(topic)
        )))
    }
}

impl PulsarOptions {
    /// Applies one `key=value` option.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "admin" => {
                let u = url::Url::parse(value).map_err(|e| {
                    Error::config(format!("'admin={value}': expected an http:// URL ({e})"))
                })?;
                if u.scheme() != "http" && u.scheme() != "https" {
                    return Err(Error::config(format!(
                        "'admin={value}': expected an http:// or https:// URL"
                    )));
                }
                self.admin_url = value.trim_end_matches('/').to_string();
            }
            "tls_trust_certs" => {
                if value.is_empty() {
                    return Err(Error::config(format!("'{key}=': expected a PEM file path")));
                }
                self.tls_trust_certs = Some(file_path(value));
            }
            "transactions" => {
                self.transactions = parse_bool(key, value)?;
            }
            "transaction_timeout_ms" => {
                let t = ms(key, value)?;
                if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&t) {
                    return Err(Error::config(format!(
                        "'{key}={value}': expected 1000 to 3600000 milliseconds"
                    )));
                }
                self.transaction_timeout = t;
            }
            "tls_hostname_verification" => {
                self.tls_hostname_verification = parse_bool(key, value)?;
            }
            "tls_allow_insecure_connection" => {
                self.tls_allow_insecure_connection = parse_bool(key, value)?;
            }
            "tls_cert_file" | "tls_key_file" => {
                if value.is_empty() {
                    return Err(Error::config(format!("'{key}=': expected a PEM file path")));
                }
                let mut c = match std::mem::take(&mut self.auth) {
                    PulsarAuth::Tls(c) => c,
                    PulsarAuth::None => TlsClientCert::default(),
                    other => {
                        self.auth = other;
                        return self.set_auth(key, PulsarAuth::None);
                    }
                };
                if key == "tls_cert_file" {
                    c.cert_file = file_path(value);
                } else {
                    c.key_file = file_path(value);
                }
                self.auth = PulsarAuth::Tls(c);
            }
            "token" => {
                if value.trim().is_empty() {
                    return Err(Error::config("'token=': expected a token"));
                }
                self.set_auth(key, PulsarAuth::Token(value.trim().to_string()))?;
            }
            "token_file" => {
                if value.is_empty() {
                    return Err(Error::config("'token_file=': expected a file path"));
                }
                self.set_auth(key, PulsarAuth::TokenFile(file_path(value)))?;
            }
            "oauth2_issuer_url"
            | "oauth2_credentials_file"
            | "oauth2_audience"
            | "oauth2_scope" => {
                let mut o = match std::mem::take(&mut self.auth) {
                    PulsarAuth::OAuth2(o) => o,
                    PulsarAuth::None => OAuth2Options {
                        issuer_url: String::new(),
                        credentials_file: PathBuf::new(),
                        audience: None,
                        scope: None,
                    },
                    other => {
                        self.auth = other;
                        return self.set_auth(key, PulsarAuth::None);
                    }
                };
                match key {
                    "oauth2_issuer_url" => {
                        let u = url::Url::parse(value).map_err(|e| {
                            Error::config(format!(
                                "'{key}={}': expected an http(s):// URL ({e})",
                                onceflow_core::shown(value)
                            ))
                        })?;
                        if u.scheme() != "http" && u.scheme() != "https" {
                            return Err(Error::config(format!(
                                "'{key}={}': expected an http(s):// URL",
                                onceflow_core::shown(value)
                            )));
                        }
                        o.issuer_url = value.to_string();
                    }
                    "oauth2_credentials_file" => o.credentials_file = file_path(value),
                    "oauth2_audience" => o.audience = Some(value.to_string()),
                    _ => o.scope = Some(value.to_string()),
                }
                self.auth = PulsarAuth::OAuth2(o);
            }
            "tenant" => self.tenant = value.to_string(),
            "namespace" => self.namespace = value.to_string(),
            "operation_timeout_ms" => {
                let d = ms(key, value)?;
                if d.is_zero() || d > MAX_OPERATION_TIMEOUT {
                    return Err(Error::config(format!(
                        "'{key}={}': expected milliseconds, 1 to {}",
                        onceflow_core::shown(value),
                        MAX_OPERATION_TIMEOUT.as_millis()
                    )));
                }
                self.operation_timeout = d;
            }
            "connection_max_retries" => {
                self.connection_max_retries = parse_num(key, value, "a retry count")?;
            }
            "connection_max_backoff_ms" => {
                let d = ms(key, value)?;
                if d < Duration::from_millis(10) || d > MAX_OPERATION_TIMEOUT {
                    return Err(Error::config(format!(
                        "'{key}={}': expected milliseconds, 10 to {}",
                        onceflow_core::shown(value),
                        MAX_OPERATION_TIMEOUT.as_millis()
                    )));
                }
                self.connection_max_backoff = d;
            }
            "batch_size" => {
                let n: u32 = parse_num(key, value, "a message count")?;
                self.batch_size = (n > 0).then_some(n);
            }
            "batch_bytes" => {
                let n: usize = parse_num(key, value, "a byte count")?;
                self.batch_bytes = (n > 0).then_some(n);
            }
            "batch_timeout_ms" => self.batch_timeout = Some(ms(key, value)?),
            "compression" => {
                self.compression = match value {
                    "none" => CompressionKind::None,
                    "lz4" => CompressionKind::Lz4,
                    "zlib" => CompressionKind::Zlib,
                    "zstd" => CompressionKind::Zstd,
                    "snappy" => CompressionKind::Snappy,
                    _ => {
                        return Err(Error::config(format!(
                            "'{key}={value}': expected none, lz4, zlib, zstd or snappy"
                        )))
                    }
                }
            }
            "producer_name" => self.producer_name = Some(value.to_string()),
            "max_message_bytes" => {
                self.max_message_bytes = parse_num(key, value, "a byte count > 16384")?;
                if self.max_message_bytes <= crate::PROPERTY_ROOM {
                    return Err(Error::config(format!(
                        "'{key}={value}': expected a byte count > {}",
                        crate::PROPERTY_ROOM
                    )));
                }
            }
            "subscription_type" => self.subscription_type = SubscriptionType::parse(key, value)?,
            "receiver_queue_size" => {
                self.receiver_queue_size = parse_num(key, value, "a message count >= 1")?;
                if self.receiver_queue_size == 0 {
                    return Err(Error::config(format!("'{key}={value}': expected >= 1")));
                }
            }
            "ack_timeout_ms" => {
                let d = ms(key, value)?;
                self.ack_timeout = (!d.is_zero()).then_some(d);
            }
            "dead_letter" => {
                check_topic(value)?;
                self.dead_letter = Some(value.to_string());
            }
            "max_redeliver" => self.max_redeliver = parse_num(key, value, "a count")?,
            "batch_index_ack" => {
                self.batch_index_ack = match value {
                    "auto" => BatchIndexAck::Auto,
                    "off" => BatchIndexAck::Off,
                    _ => {
                        return Err(Error::config(format!(
                            "'{key}={value}': expected auto or off"
                        )))
                    }
                }
            }
            "refresh_ms" => {
                self.refresh = ms(key, value)?;
                if self.refresh.is_zero() {
                    return Err(Error::config(format!("'{key}={value}': expected > 0")));
                }
            }
            other => {
                if let Some(k) = other.strip_prefix("metadata.") {
                    if !k.is_empty() {
                        self.metadata.insert(k.to_string(), value.to_string());
                        return Ok(());
                    }
                }
                return Err(Error::config(format!(
                    "unknown pulsar option '{}': expected one of admin, tenant, namespace, \
                     operation_timeout_ms, connection_max_retries, connection_max_backoff_ms, \
                     batch_size, batch_bytes, batch_timeout_ms, \
                     compression, producer_name, max_message_bytes, subscription_type, \
                     receiver_queue_size, ack_timeout_ms, dead_letter, max_redeliver, \
                     batch_index_ack, refresh_ms, metadata.KEY, tls_trust_certs, \
                     tls_cert_file, tls_key_file, tls_hostname_verification, \
                     tls_allow_insecure_connection, token, token_file, oauth2_issuer_url, \
                     oauth2_credentials_file, oauth2_audience, oauth2_scope, transactions, \
                     transaction_timeout_ms",
                    onceflow_core::shown(other)
                )));
            }
        }
        Ok(())
    }

    /// Sets the one way of authenticating; a second one is a `Config` error.
    fn set_auth(&mut self, key: &str, auth: PulsarAuth) -> Result<()> {
        if self.auth != PulsarAuth::None || auth == PulsarAuth::None {
            return Err(Error::config(format!(
                "'{key}' with another credential: give one of token, token_file, the \
                 oauth2_* keys or tls_cert_file + tls_key_file"
            )));
        }
        self.auth = auth;
        Ok(())
    }

    /// Applies several options (a consumer's or producer's `options`). The connection's own
    /// keys (TLS and credentials) are a `Config` error here: they belong on the URL.
    pub fn apply(&mut self, options: &BTreeMap<String, String>) -> Result<()> {
        for (k, v) in options {
            if CONNECTION_KEYS.contains(&k.as_str()) || k.starts_with("oauth2_") {
                return Err(Error::config(format!(
                    "'{k}' is an option of the connection: give it on the pulsar+ssl:// URL, \
                     not per consumer or producer"
                )));
            }
            self.set(k, v)?;
        }
        Ok(())
    }

    /// Checks options that only make sense together.
    pub(crate) fn validate(&self) -> Result<()> {
        let tls = self.service_url.starts_with("pulsar+ssl://");
        if let PulsarAuth::Tls(c) = &self.auth {
            if c.cert_file.as_os_str().is_empty() || c.key_file.as_os_str().is_empty() {
                return Err(Error::config(
                    "a TLS client certificate needs both tls_cert_file and tls_key_file",
                ));
            }
            if !tls {
                return Err(Error::config(format!(
                    "tls_cert_file on {}: a client certificate needs a TLS connection, \
                     pulsar+ssl://host:6651",
                    onceflow_core::redact_credentials(&self.service_url)
                )));
            }
        } else {
            if !self.tls_hostname_verification {
                return Err(Error::unsupported(
                    "'tls_hostname_verification=false' without a client certificate: the \
                     pulsar crate's rustls TLS always verifies that the broker's certificate \
                     names the host of the URL (only the mTLS bridge, tls_cert_file + \
                     tls_key_file, makes its own TLS connection); connect with a name the \
                     certificate has",
                ));
            }
            if self.tls_allow_insecure_connection {
                return Err(Error::unsupported(
                    "'tls_allow_insecure_connection=true' without a client certificate: the \
                     pulsar crate's rustls TLS always verifies the broker's certificate (only \
                     the mTLS bridge, tls_cert_file + tls_key_file, makes its own TLS \
                     connection); trust its CA with tls_trust_certs=/path/ca.pem",
                ));
            }
        }
        if let PulsarAuth::OAuth2(o) = &self.auth {
            if o.issuer_url.is_empty() || o.credentials_file.as_os_str().is_empty() {
                return Err(Error::config(
                    "OAuth2 needs both oauth2_issuer_url and oauth2_credentials_file",
                ));
            }
        }
        if self.dead_letter.is_some() != (self.max_redeliver > 0) {
            return Err(Error::config(format!(
                "dead_letter={} with max_redeliver={}: a dead-letter policy needs both a topic \
                 and max_redeliver > 0",
                self.dead_letter.as_deref().unwrap_or("(none)"),
                self.max_redeliver
            )));
        }
        Ok(())
    }

    /// Whether producers batch.
    pub fn batching(&self) -> bool {
        self.batch_size.is_some_and(|n| n > 1)
            || self.batch_bytes.is_some()
            || self.batch_timeout.is_some()
    }

    /// The full topic name: `persistent://tenant/namespace/name`.
    pub fn full_topic(&self, topic: &str) -> String {
        if topic.contains("://") {
            topic.to_string()
        } else if topic.split('/').count() == 3 {
            format!("persistent://{topic}")
        } else {
            format!("persistent://{}/{}/{topic}", self.tenant, self.namespace)
        }
    }

    /// The admin REST path of a topic: `TENANT/NAMESPACE/NAME` (URL-encoded name).
    pub(crate) fn admin_path(&self, topic: &str) -> String {
        let full = self.full_topic(topic);
        let rest = full
            .split_once("://")
            .map(|(_, r)| r)
            .unwrap_or(full.as_str());
        rest.split('/')
            .map(|p| url::form_urlencoded::byte_serialize(p.as_bytes()).collect::<String>())
            .collect::<Vec<_>>()
            .join("/")
    }
}

/// Parses `pulsar://host:port?key=value&…` or `pulsar+ssl://host:port?key=value&…` (TLS;
/// the admin URL then defaults to `https://host:8443`, Pulsar's `webServicePortTls`). Errors
/// quote the URL with its secrets (`token=`) replaced by `***`.
pub fn parse_url(url: &str) -> Result<PulsarOptions> {
    let shown_url = onceflow_core::redact_url(url);
    let (scheme, rest) = if let Some(r) = url.strip_prefix("pulsar://") {
        ("pulsar", r)
    } else if let Some(r) = url.strip_prefix("pulsar+ssl://") {
        ("pulsar+ssl", r)
    } else {
        return Err(Error::config(format!(
            "'{shown_url}' is not a Pulsar URL: expected pulsar://host:port?admin=http://host:port \
             or pulsar+ssl://host:port?admin=https://host:port"
        )));
    };
    let (host, query) = match rest.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (rest, None),
    };
    let host = host.trim_end_matches('/');
    if host.contains('@') {
        return Err(Error::config(format!(
            "'{shown_url}' has credentials before the host (user:password@), which a Pulsar URL \
             does not take: expected {scheme}://host:port, with the credentials as token=, \
             token_file=, oauth2_issuer_url= and oauth2_credentials_file=, or tls_cert_file= \
             and tls_key_file="
        )));
    }
    if host.is_empty() || host.contains(',') {
        return Err(Error::config(format!(
            "'{shown_url}' must name one broker: expected {scheme}://host:port"
        )));
    }
    let hostname = host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host);
    let admin_url = if scheme == "pulsar+ssl" {
        format!("https://{hostname}:8443")
    } else {
        format!("http://{hostname}:8080")
    };
    let mut opts = PulsarOptions {
        service_url: format!("{scheme}://{host}"),
        admin_url,
        ..Default::default()
    };
    if let Some(q) = query {
        for (k, v) in url::form_urlencoded::parse(q.as_bytes()) {
            opts.set(&k, &v)?;
        }
    }
    opts.validate()?;
    Ok(opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceflow_core::ErrorKind;

    #[test]
    fn parses_host_admin_and_options() {
        let o = parse_url(
            "pulsar://127.0.0.1:16650?admin=http://127.0.0.1:18080&batch_size=100&compression=lz4&subscription_type=key_shared&metadata.team=a",
        )
        .unwrap();
        assert_eq!(o.service_url, "pulsar://127.0.0.1:16650");
        assert_eq!(o.admin_url, "http://127.0.0.1:18080");
        assert_eq!(o.batch_size, Some(100));
        assert!(o.batching());
        assert_eq!(o.compression, CompressionKind::Lz4);
        assert_eq!(o.subscription_type, SubscriptionType::KeyShared);
        assert_eq!(o.metadata.get("team").map(String::as_str), Some("a"));
        assert_eq!(
            parse_url("pulsar://h:6650").unwrap().admin_url,
            "http://h:8080"
        );
        let e = parse_url("pulsar://h:1?bogus=1").unwrap_err();
        assert!(e.message().contains("bogus"));
        let e = parse_url("pulsar://u:pw-SECRET@h:1?bogus=1").unwrap_err();
        assert!(e.message().contains("token="), "{e}");
        assert!(!e.message().contains("pw-SECRET"), "{e}");
        assert!(parse_url("kafka://h:1").is_err());
        assert!(parse_url("pulsar://h:1?subscription_type=nope").is_err());
        assert!(parse_url("pulsar://h:1?dead_letter=dlq").is_err());
        assert!(parse_url("pulsar://h:1?dead_letter=dlq&max_redeliver=3").is_ok());
        for bad in ["0", "3600001", "-5", "soon"] {
            let e = parse_url(&format!("pulsar://h:1?operation_timeout_ms={bad}")).unwrap_err();
            assert!(
                e.message().contains(&format!("operation_timeout_ms={bad}")),
                "{e}"
            );
        }
        assert_eq!(
            parse_url("pulsar://h:1?operation_timeout_ms=3600000")
                .unwrap()
                .operation_timeout,
            Duration::from_secs(3600)
        );
        let o = parse_url("pulsar://h:1?connection_max_retries=2&connection_max_backoff_ms=200")
            .unwrap();
        assert_eq!(o.connection_max_retries, 2);
        assert_eq!(o.connection_max_backoff, Duration::from_millis(200));
        for bad in ["connection_max_retries=-1", "connection_max_backoff_ms=5"] {
            let e = parse_url(&format!("pulsar://h:1?{bad}")).unwrap_err();
            assert!(e.message().contains(bad), "{e}");
        }
        let mut per_consumer = PulsarOptions::default();
        let e = per_consumer
            .apply(&[("connection_max_retries".to_string(), "1".to_string())].into())
            .unwrap_err();
        assert!(e.message().contains("option of the connection"), "{e}");
    }

    #[test]
    fn tls_and_credentials() {
        let o = parse_url(
            "pulsar+ssl://broker.example:6651?tls_trust_certs=/etc/ca.pem&token=eyJ.secret.sig",
        )
        .unwrap();
        assert_eq!(o.service_url, "pulsar+ssl://broker.example:6651");
        assert_eq!(o.admin_url, "https://broker.example:8443");
        assert_eq!(o.tls_trust_certs, Some(PathBuf::from("/etc/ca.pem")));
        assert_eq!(o.auth, PulsarAuth::Token("eyJ.secret.sig".to_string()));
        let debug = format!("{o:?}");
        assert!(!debug.contains("secret"), "{debug}");
        assert!(debug.contains("Token(***)"), "{debug}");
        assert_eq!(
            parse_url("pulsar://h:1?token_file=file:///run/token")
                .unwrap()
                .auth,
            PulsarAuth::TokenFile(PathBuf::from("/run/token"))
        );
        let o = parse_url(
            "pulsar+ssl://h:1?oauth2_issuer_url=https://auth.example/&oauth2_credentials_file=/k.json&oauth2_audience=urn:a",
        )
        .unwrap();
        match o.auth {
            PulsarAuth::OAuth2(o) => {
                assert_eq!(o.issuer_url, "https://auth.example/");
                assert_eq!(o.credentials_file, PathBuf::from("/k.json"));
                assert_eq!(o.audience.as_deref(), Some("urn:a"));
            }
            other => panic!("{other:?}"),
        }
        // One credential at most; OAuth2 needs both keys.
        let e = parse_url("pulsar://h:1?token=abcdefgh&token_file=/t").unwrap_err();
        assert!(!e.to_string().contains("abcdefgh"), "{e}");
        assert!(parse_url("pulsar://h:1?oauth2_issuer_url=https://a/&token=x").is_err());
        assert!(parse_url("pulsar://h:1?oauth2_issuer_url=https://a/").is_err());
        // What the crate's rustls TLS cannot do is said, not ignored; a half-given client
        // certificate or one on a plaintext URL is a Config error.
        for (q, kind) in [
            ("tls_hostname_verification=false", ErrorKind::Unsupported),
            ("tls_allow_insecure_connection=true", ErrorKind::Unsupported),
            ("tls_cert_file=/c.pem", ErrorKind::Config),
            ("tls_key_file=/c.key", ErrorKind::Config),
            (
                "tls_cert_file=/c.pem&tls_key_file=/c.key&token=abcdefgh",
                ErrorKind::Config,
            ),
            ("token=abcdefgh&tls_cert_file=/c.pem", ErrorKind::Config),
            ("tls_hostname_verification=maybe", ErrorKind::Config),
        ] {
            let e = parse_url(&format!("pulsar+ssl://h:1?{q}")).unwrap_err();
            assert_eq!(e.kind(), kind, "{q}: {e}");
            assert!(!e.to_string().contains("abcdefgh"), "{e}");
        }
        let e = parse_url("pulsar://h:1?tls_cert_file=/c.pem&tls_key_file=/c.key").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.message().contains("pulsar+ssl://"), "{e}");
        // A client certificate: the TLS is onceflow's, so both flags are taken.
        let o = parse_url(
            "pulsar+ssl://h:1?tls_cert_file=file:///c.pem&tls_key_file=/c.key&tls_hostname_verification=false&tls_allow_insecure_connection=true",
        )
        .unwrap();
        assert_eq!(
            o.auth,
            PulsarAuth::Tls(TlsClientCert {
                cert_file: PathBuf::from("/c.pem"),
                key_file: PathBuf::from("/c.key"),
            })
        );
        assert!(!o.tls_hostname_verification);
        assert!(o.tls_allow_insecure_connection);
        assert!(parse_url("pulsar+ssl://h:1?tls_hostname_verification=true").is_ok());
        // Errors quote the URL without the token.
        let e = parse_url("pulsar+ssl://a,b:1?token=abcdefgh12345").unwrap_err();
        assert!(!e.to_string().contains("abcdefgh12345"), "{e}");
        let e = parse_url("pulsar+ssl://h:1?token=abcdefgh12345&nope=1").unwrap_err();
        assert!(!e.to_string().contains("abcdefgh12345"), "{e}");
        // Connection keys are not per consumer / producer options.
        let mut o = PulsarOptions::default();
        let mut m = BTreeMap::new();
        m.insert("token".to_string(), "abcdefgh".to_string());
        let e = o.apply(&m).unwrap_err();
        assert!(e.message().contains("option of the connection"), "{e}");
        assert!(!e.to_string().contains("abcdefgh"), "{e}");
    }

    #[test]
    fn topic_names() {
        let o = PulsarOptions::default();
        assert_eq!(o.full_topic("t"), "persistent://public/default/t");
        assert_eq!(o.full_topic("a/b/t"), "persistent://a/b/t");
        assert_eq!(o.admin_path("t"), "public/default/t");
        assert!(check_topic("ok-name_1").is_ok());
        assert!(check_topic("persistent://public/default/t").is_ok());
        assert!(check_topic("persistent://t").is_err());
        assert_eq!(
            check_topic("non-persistent://public/default/t")
                .unwrap_err()
                .kind(),
            onceflow_core::ErrorKind::Unsupported
        );
        assert!(check_topic("bad name").is_err());
        assert!(check_topic("").is_err());
    }
}
