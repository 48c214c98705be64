//! # onceflow-kinesis
//!
//! The AWS Kinesis Data Streams backend of onceflow (`kinesis://`), on the AWS SDK for Rust
//! ([aws-sdk-kinesis]). Kinesis has no consumer groups, no headers, no idempotent put and no
//! transactions; this crate adds what a consumer library needs on top (a lease table, as AWS's
//! Java-only [KCL] does) and declares the rest missing in [`CAPABILITIES`].
//!
//! ## URL
//! `kinesis://[host:port][?key=value&…]`, keys in [`KinesisOptions`]. Unknown keys and bad
//! values are `Config` errors naming the key (never the value of one that may be secret).
//!
//! | Key | Value | Follows |
//! |---|---|---|
//! | `host:port` | endpoint override, `http://host:port` (or `https://` with `tls=true`), for a local Kinesis-compatible server | [Endpoints] |
//! | `endpoint=` | endpoint override as a full `http(s)://` URL (a VPC endpoint, a proxy, a local server); not with `host:port` | [Endpoints] (`endpoint_url`) |
//! | `tls=` | `true`: `https://` for `host:port` | |
//! | `region=` | AWS region the requests are sent to and signed for | [Region] |
//! | `profile=` | named profile of the shared config and credentials files | [Shared files], [Profiles] |
//! | `role_arn=` | IAM role to assume through STS [AssumeRole] | [Assume role] |
//! | `role_session_name=` | its `RoleSessionName` (2-64 chars) | [AssumeRole] |
//! | `external_id=` | its `ExternalId` (hidden in errors and `Debug`) | [AssumeRole], [External id] |
//! | `role_duration_s=` | its `DurationSeconds` (900-43 200) | [AssumeRole] |
//! | `dummy_credentials=` | `true`: fixed local test keys only; `false`: never them | |
//! | `checkpoint_store=`, `lease_ms=`, `shards=`, `auto_create=`, `fetch_limit=`, `idle_ms=`, `put_attempts=`, `buffer=`, `fan_out=`, `efo_consumer=`, `timeout_ms=` | see [`KinesisOptions`] | |
//!
//! Without an endpoint override the SDK's endpoint is used: AWS's regional endpoint, or the
//! one the SDK is configured with (`AWS_ENDPOINT_URL_KINESIS`, `AWS_ENDPOINT_URL`, a profile's
//! `services` section; see [Endpoints]). The endpoint override applies to Kinesis only: STS
//! (web identity, assumed roles) keeps its own endpoint (AWS's, or `AWS_ENDPOINT_URL_STS`).
//!
//! ## Credentials and region
//! Credentials never come from the URL (a URL with `user:password@` is refused): they come
//! from aws-config's own providers, in this order of precedence.
//!
//! 1. `dummy_credentials=true`: fixed local test keys (`onceflow-local`), nothing else. For a
//!    local server, which needs a signed request but accepts any key.
//! 2. `profile=NAME`: that profile only, as the AWS CLI's `--profile` (environment keys are
//!    not used). The profile may hold static keys, `credential_process` ([Process
//!    credentials]), `role_arn` with `source_profile` or `credential_source`,
//!    `web_identity_token_file`, or SSO (`sso_session`; log in with `aws sso login`). A
//!    profile that does not exist is an `Auth` error naming it.
//! 3. Otherwise the SDK's default chain ([Credential chain]):
//!    environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`; [Environment]),
//!    the shared files' profile (`AWS_PROFILE`, else `default`; files at `AWS_CONFIG_FILE` /
//!    `AWS_SHARED_CREDENTIALS_FILE`, else `~/.aws/config` and `~/.aws/credentials`),
//!    web identity (`AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN` [+ `AWS_ROLE_SESSION_NAME`],
//!    as EKS IRSA sets them; [Web identity]), container credentials (ECS/EKS Pod Identity:
//!    `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI` / `_FULL_URI`; [Container]) and instance
//!    metadata (IMDSv2; [IMDS]). The first that has credentials is used; one that is
//!    configured but fails (a `credential_process` exiting non-zero, an unreadable token file)
//!    stops the chain with an `Auth` error.
//! 4. For a **loopback endpoint** (`localhost`, `127.0.0.0/8`, `::1`) and no
//!    `dummy_credentials=`, instance metadata is not asked, and when no other source has
//!    credentials *and no credential variable is set* (`AWS_ACCESS_KEY_ID`,
//!    `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_PROFILE`, `AWS_WEB_IDENTITY_TOKEN_FILE`,
//!    `AWS_ROLE_ARN`, `AWS_CONTAINER_CREDENTIALS_*`) the fixed local test keys sign the
//!    requests. A half-configured source (a key id without its secret, an `AWS_PROFILE` that
//!    is missing) is an `Auth` error, never silently replaced by those keys.
//!    `dummy_credentials=false` asks the full chain of 3 with no fallback.
//! 5. `role_arn=`: the credentials found above call STS AssumeRole for that role
//!    (aws-config's `AssumeRoleProvider`, refreshed before they expire), and the role's
//!    credentials sign the Kinesis calls.
//!
//! **Region**: `region=`, else `AWS_REGION`, else the profile's `region` (`profile=`, else
//! `AWS_PROFILE` or `default`), else (AWS's endpoint only) instance metadata; with an endpoint
//! override and none of these, `us-east-1`. Without an endpoint override and no region
//! anywhere, connecting is a `Config` error. Requests are signed (SigV4) for that region.
//!
//! **Errors**: credentials that cannot be loaded make the call an `Auth` error naming where
//! they were looked for (the profile and files, or the chain, or the role) and what the
//! provider said (a `credential_process`'s exit status and stderr, a missing profile, STS's
//! refusal); AWS refusing them (`UnrecognizedClientException`, `InvalidSignatureException`,
//! `ExpiredTokenException`, `AccessDeniedException`, …) is an `Auth` error with the
//! service's code. With an endpoint override, connecting makes one `ListStreams` call, so
//! such errors come at connect; against AWS's endpoint, at first use. No secret access key,
//! session token or web identity token is in any error, `Debug` output or onceflow log line;
//! the connection's credential source is logged at debug level.
//!
//! [Endpoints]: https://docs.aws.amazon.com/sdkref/latest/guide/feature-ss-endpoints.html
//! [Region]: https://docs.aws.amazon.com/sdkref/latest/guide/feature-region.html
//! [Shared files]: https://docs.aws.amazon.com/sdkref/latest/guide/file-format.html
//! [Profiles]: https://docs.aws.amazon.com/cli/latest/userguide/cli-configure-files.html
//! [Credential chain]: https://docs.aws.amazon.com/sdk-for-rust/latest/dg/credproviders.html
//! [Environment]: https://docs.aws.amazon.com/sdkref/latest/guide/environment-variables.html
//! [Process credentials]: https://docs.aws.amazon.com/sdkref/latest/guide/feature-process-credentials.html
//! [Web identity]: https://docs.aws.amazon.com/sdkref/latest/guide/feature-assume-role-credentials.html
//! [Assume role]: https://docs.aws.amazon.com/sdkref/latest/guide/feature-assume-role-credentials.html
//! [AssumeRole]: https://docs.aws.amazon.com/STS/latest/APIReference/API_AssumeRole.html
//! [External id]: https://docs.aws.amazon.com/IAM/latest/UserGuide/id_roles_common-scenarios_third-party.html
//! [Container]: https://docs.aws.amazon.com/sdkref/latest/guide/feature-container-credentials.html
//! [IMDS]: https://docs.aws.amazon.com/sdkref/latest/guide/feature-imds-credentials.html
//!
//! ## Streams, shards, partitions
//! - A **topic is a stream**; missing streams are created on first use with `shards=` shards
//!   (`auto_create=false` turns that off).
//! - **A partition is a shard**: partition `n` is `shardId-<n in 12 digits>`
//!   ([`partition_of_shard`]). Kinesis numbers a stream's shards from 0 and gives shards made by
//!   a split or merge the next unused numbers, so the mapping is stable; after resharding a
//!   stream has more partitions than open shards (closed parents keep their numbers).
//! - **Positions** are sequence numbers ([`onceflow_core::Position::SequenceNumber`]).
//! - **Keys**: the record key is the partition key when it is UTF-8 of 1 to 256 characters;
//!   otherwise the partition key is `hex:` + its XXH3-128 and the exact key travels in the
//!   envelope. An unkeyed record gets a random partition key (and the envelope's "unkeyed"
//!   flag). An explicit partition is honoured with `ExplicitHashKey` = the shard's starting hash
//!   key. Records with one key go to one shard and keep their order there (and, across a split,
//!   in the parent first and then in the child: see the consumer).
//! - **Envelope**: headers, the record timestamp and a non-UTF-8 key are written in the
//!   versioned binary envelope of [`envelope`] (`docs/kinesis-envelope.md`). A record without
//!   the envelope's magic (written by boto3, the AWS CLI, …) reads as a plain payload: no
//!   headers, the partition key as key, the arrival time as timestamp. A damaged envelope is a
//!   `Serialization` error for that record only: the consumer hands it on as a message with the
//!   raw data as payload and the header `onceflow-envelope-error` (so the engine's failure
//!   policy, dead-letter or skip, decides), and the shard goes on.
//!
//! ## Producer
//! PutRecords packing: 500 records and 5 MiB per call, 1 MiB per record (data + partition key);
//! on a partial failure only the failed entries are retried, with exponential backoff (also for
//! throttling of the whole call), at most `put_attempts` times. See [`KinesisProducer`].
//!
//! ## Consumer
//! A consumer library with a lease table in a [`CheckpointStore`](onceflow_core::checkpoint):
//! see [`KinesisConsumer`].
//!
//! **Enhanced fan-out**: `fan_out=efo` reads held shards through [SubscribeToShard] with a
//! registered stream consumer (`efo_consumer=`, default the group's name; registered on join
//! if missing, reused if present) instead of GetRecords polling; leases, checkpoints, resharding
//! and lag work the same. A server without it fails with `Unsupported` naming its answer;
//! `fan_out=auto` polls there instead (logged once). AWS needs HTTP/2 for event streams, which
//! the SDK's HTTPS client negotiates (ALPN); kinesis-local also streams events over plain
//! HTTP/1.1 (chunked), which is what the tests use. See [`FanOut`].
//!
//! [SubscribeToShard]: https://docs.aws.amazon.com/kinesis/latest/APIReference/API_SubscribeToShard.html
//!
//! [aws-sdk-kinesis]: https://docs.rs/aws-sdk-kinesis
//! [KCL]: https://docs.aws.amazon.com/streams/latest/dev/shared-throughput-kcl-consumers.html

mod admin;
mod config;
mod consumer;
mod credentials;
mod efo;
pub mod envelope;
mod producer;
mod shards;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_kinesis::Client;
use onceflow_core::checkpoint::{MemoryCheckpointStore, SharedCheckpointStore};
use onceflow_core::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, PlatformBackend,
    ProducerBackend, ProducerConfig, Result,
};
use parking_lot::Mutex;
use tokio::sync::OnceCell;

pub use admin::KinesisAdmin;
pub use config::{parse_url, FanOut, KinesisOptions};
pub use consumer::{KinesisConsumer, ENVELOPE_ERROR_HEADER, SHARD_END};
pub use producer::{
    partition_key_of, KinesisProducer, MAX_BYTES_PER_CALL, MAX_BYTES_PER_RECORD,
    MAX_RECORDS_PER_CALL,
};
pub use shards::{partition_of_shard, shard_of_partition, ShardInfo};

/// Bytes of the 1 MiB record limit kept for the envelope and the partition key.
const ENVELOPE_ROOM: usize = 4096;

/// What Kinesis can do through this adapter.
pub const CAPABILITIES: Capabilities = Capabilities {
    transactions: false,
    idempotent_producer: false,
    dedup_by_id: false,
    atomic_batch: false,
    native_headers: false,
    consumer_groups: true,
    seek_by_timestamp: true,
    pause_resume: true,
    per_message_nack: false,
    compaction: false,
    lag_ms: true,
    batch_index_ack: false,
};

/// Connects to the endpoint named in `url` (see the crate docs).
pub async fn connect(url: &str) -> Result<Arc<KinesisPlatform>> {
    KinesisPlatform::connect(url).await
}

/// State shared by the producers, consumers and admin handle of one connection.
pub(crate) struct Shared {
    pub(crate) client: Client,
    pub(crate) options: KinesisOptions,
    store: OnceCell<SharedCheckpointStore>,
    /// Shards per stream, as last listed.
    streams: Mutex<HashMap<String, Vec<ShardInfo>>>,
    put_in_flight: AtomicBool,
}

impl Shared {
    pub(crate) fn max_record_bytes(&self) -> usize {
        MAX_BYTES_PER_RECORD - ENVELOPE_ROOM
    }

    pub(crate) fn put_in_flight(&self) -> bool {
        self.put_in_flight.load(Ordering::Acquire)
    }

    pub(crate) fn set_put_in_flight(&self, v: bool) {
        self.put_in_flight.store(v, Ordering::Release);
    }

    pub(crate) fn forget_stream(&self, name: &str) {
        self.streams.lock().remove(name);
    }

    /// The lease table store: `checkpoint_store=` if given, else one in-memory table for this
    /// connection.
    pub(crate) async fn checkpoint_store(&self) -> Result<SharedCheckpointStore> {
        self.store
            .get_or_try_init(|| async {
                match &self.options.checkpoint_store {
                    Some(url) => onceflow_core::checkpoint::open(url).await,
                    None => Ok(Arc::new(MemoryCheckpointStore::new()) as SharedCheckpointStore),
                }
            })
            .await
            .cloned()
    }

    /// Waits until the stream is ACTIVE (at most 60 s).
    pub(crate) async fn wait_active(&self, name: &str) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let d = self
                .client
                .describe_stream_summary()
                .stream_name(name)
                .send()
                .await
                .map_err(|e| shards::aws_err(format!("DescribeStreamSummary of '{name}'"), e))?;
            if d.stream_description_summary()
                .is_some_and(|s| admin::is_active(s.stream_status()))
            {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("stream '{name}' not ACTIVE after 60 s"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Creates a stream with `shards` shards and waits until it is ACTIVE; `Config` if it
    /// exists with another shard count.
    pub(crate) async fn create_stream(&self, name: &str, shards: u32) -> Result<()> {
        let r = self
            .client
            .create_stream()
            .stream_name(name)
            .shard_count(i32::try_from(shards).unwrap_or(i32::MAX))
            .send()
            .await;
        if let Err(e) = r {
            let err = shards::aws_err(format!("CreateStream '{name}'"), e);
            if !err.message().contains("ResourceInUseException") {
                return Err(err);
            }
            self.wait_active(name).await?;
            let open = shards::list_shards(&self.client, name)
                .await?
                .iter()
                .filter(|s| !s.closed)
                .count();
            if open != shards as usize {
                return Err(Error::config(format!(
                    "stream '{name}' already exists with {open} open shards, not {shards}"
                )));
            }
            return Ok(());
        }
        self.wait_active(name).await
    }

    /// The shards of a stream, creating it when missing and `auto_create` is on.
    pub(crate) async fn ensure_stream(&self, name: &str) -> Result<()> {
        if self.streams.lock().contains_key(name) {
            return Ok(());
        }
        self.refresh_shards(name).await.map(|_| ())
    }

    pub(crate) async fn refresh_shards(&self, name: &str) -> Result<Vec<ShardInfo>> {
        let list = match shards::list_shards(&self.client, name).await {
            Ok(l) => l,
            Err(e) if e.kind() == ErrorKind::NotFound && self.options.auto_create => {
                self.create_stream(name, self.options.shards).await?;
                shards::list_shards(&self.client, name).await?
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("topic '{name}' does not exist (no Kinesis stream of that name)"),
                ))
            }
            Err(e) => return Err(e),
        };
        self.streams.lock().insert(name.to_string(), list.clone());
        Ok(list)
    }

    /// `ExplicitHashKey` for partition `p`: the starting hash key of that open shard.
    pub(crate) async fn hash_key_of_partition(&self, stream: &str, p: i32) -> Result<String> {
        for fresh in [false, true] {
            let list = if fresh {
                self.refresh_shards(stream).await?
            } else {
                self.streams.lock().get(stream).cloned().unwrap_or_default()
            };
            if let Some(s) = list.iter().find(|s| s.partition == p && !s.closed) {
                return Ok(s.starting_hash_key.clone());
            }
        }
        Err(Error::config(format!(
            "partition {p} of stream '{stream}' is not an open shard ({})",
            shard_of_partition(p)
        )))
    }
}

/// A connection to Kinesis (or a compatible server): the factory of producers, consumers and
/// the admin handle.
pub struct KinesisPlatform {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for KinesisPlatform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KinesisPlatform")
            .field("endpoint", &self.shared.options.endpoint)
            .field("region", &self.shared.options.region)
            .finish()
    }
}

/// One `ListStreams` call: any answer (even a refusal) shows the endpoint is a server that
/// answers; no connection, or no answer within `timeout`, is a `Connect` error naming it.
async fn check_answers(client: &Client, endpoint: &str, timeout: Duration) -> Result<()> {
    use aws_sdk_kinesis::error::SdkError;
    match client.list_streams().limit(1).send().await {
        Ok(_) | Err(SdkError::ServiceError(_)) | Err(SdkError::ResponseError(_)) => Ok(()),
        Err(e @ SdkError::TimeoutError(_)) => Err(Error::new(
            ErrorKind::Connect,
            format!("Kinesis endpoint {endpoint} did not answer within {timeout:?} (timeout_ms)"),
        )
        .with_source(e)),
        Err(e) => {
            if let Some(ce) = credentials::find_credentials_error(&e) {
                return Err(credentials::auth_error(
                    &format!("endpoint {endpoint}: ListStreams"),
                    ce,
                ));
            }
            Err(Error::new(
                ErrorKind::Connect,
                format!(
                    "Kinesis endpoint {endpoint}: {}",
                    shards::aws_err("ListStreams".to_string(), e)
                        .message()
                        .trim_start_matches("Kinesis ")
                ),
            ))
        }
    }
}

impl KinesisPlatform {
    /// Connects to `url`. `Config` for a bad URL (or no region for AWS's endpoint). With an
    /// endpoint in the URL (a local Kinesis-compatible server), one `ListStreams` call checks
    /// that it answers within the operation timeout (`timeout_ms`); if not, a `Connect` error
    /// names the endpoint, and credentials that cannot be loaded or are refused are an `Auth`
    /// error naming where they were looked for (see the crate docs, "Credentials and region").
    /// Against AWS's regional endpoint nothing is sent until first use.
    pub async fn connect(url: &str) -> Result<Arc<KinesisPlatform>> {
        Self::connect_with(parse_url(url)?, None).await
    }

    /// Connects with typed options and, optionally, a lease table store to use instead of
    /// `options.checkpoint_store` (for Redis / PostgreSQL stores opened by the caller).
    pub async fn connect_with(
        options: KinesisOptions,
        store: Option<SharedCheckpointStore>,
    ) -> Result<Arc<KinesisPlatform>> {
        // Without timeouts the SDK waits forever on an endpoint that accepts connections and
        // never answers. The operation timeout covers one call with its retries; the connect
        // timeout stays the SDK's (3.1 s) unless the operation's is shorter.
        let timeouts = aws_config::timeout::TimeoutConfig::builder()
            .operation_timeout(options.timeout)
            .connect_timeout(options.timeout.min(Duration::from_millis(3100)))
            .build();
        let resolved = credentials::resolve(&options, timeouts).await?;
        tracing::debug!(
            endpoint = options.endpoint.as_deref().unwrap_or("AWS regional endpoint"),
            region = resolved.sdk.region().map(|r| r.as_ref()).unwrap_or(""),
            credentials = %resolved.source,
            "Kinesis connection"
        );
        // The endpoint override is the Kinesis client's only: STS (web identity, assumed
        // roles) keeps its own endpoint (AWS's, or AWS_ENDPOINT_URL_STS).
        let mut conf = aws_sdk_kinesis::config::Builder::from(&resolved.sdk);
        if let Some(e) = &options.endpoint {
            conf = conf.endpoint_url(e);
        }
        let client = Client::from_conf(conf.build());
        if let Some(endpoint) = &options.endpoint {
            check_answers(&client, endpoint, options.timeout).await?;
        }
        let cell = OnceCell::new();
        if let Some(s) = store {
            let _ = cell.set(s);
        }
        Ok(Arc::new(KinesisPlatform {
            shared: Arc::new(Shared {
                client,
                options,
                store: cell,
                streams: Mutex::new(HashMap::new()),
                put_in_flight: AtomicBool::new(false),
            }),
        }))
    }

    /// The connection's options.
    pub fn options(&self) -> &KinesisOptions {
        &self.shared.options
    }

    /// The AWS SDK client, for anything onceflow does not cover (resharding, for example).
    pub fn client(&self) -> Client {
        self.shared.client.clone()
    }

    /// Every shard of `stream` (open and closed), by partition.
    pub async fn shards(&self, stream: &str) -> Result<Vec<ShardInfo>> {
        self.shared.refresh_shards(stream).await
    }

    /// The lease table store consumers of this connection use.
    pub async fn checkpoint_store(&self) -> Result<SharedCheckpointStore> {
        self.shared.checkpoint_store().await
    }
}

#[async_trait]
impl PlatformBackend for KinesisPlatform {
    fn name(&self) -> &'static str {
        "kinesis"
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    async fn producer(&self, config: ProducerConfig) -> Result<Arc<dyn ProducerBackend>> {
        Ok(Arc::new(KinesisProducer::new(self.shared.clone(), config)))
    }

    async fn consumer(&self, config: ConsumerConfig) -> Result<Arc<dyn ConsumerBackend>> {
        Ok(KinesisConsumer::join(self.shared.clone(), config).await?)
    }

    async fn admin(&self) -> Result<Arc<dyn AdminBackend>> {
        Ok(Arc::new(KinesisAdmin {
            shared: self.shared.clone(),
        }))
    }

    fn max_record_bytes(&self) -> usize {
        self.shared.max_record_bytes()
    }

    fn max_record_bytes_source(&self) -> Option<&'static str> {
        Some("Kinesis's 1 MiB per record, less 4 KiB for the envelope and partition key")
    }
}

/// This adapter's entry in the backend registry (`onceflow_core::registry`): the scheme
/// `kinesis` and how to connect. A `checkpoint_store=` on a shared store (Redis, PostgreSQL:
/// any scheme but `memory://` and `embedded://` or a file path, which the adapter opens itself)
/// is opened now through the registry's openers, so a wrong store URL fails the connect.
pub const PLATFORM: onceflow_core::registry::PlatformEntry =
    onceflow_core::registry::PlatformEntry {
        name: "kinesis",
        schemes: &["kinesis://"],
        connect: |url, openers| {
            onceflow_core::registry::boxed(async move {
                let options = parse_url(&url)?;
                let shared = options.checkpoint_store.as_deref().filter(|s| {
                    onceflow_core::registry::scheme_of(s)
                        .is_some_and(|scheme| scheme != "memory" && scheme != "embedded")
                });
                let store = match shared {
                    Some(s) => Some((openers.checkpoint_store)(s.to_string()).await?),
                    None => None,
                };
                Ok(onceflow_core::registry::client(
                    KinesisPlatform::connect_with(options, store).await?,
                ))
            })
        },
    };
