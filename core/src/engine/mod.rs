//! The engine: [`IdempotentConsumer`] (at-least-once delivery plus a dedup store) and
//! [`Pipeline`] (consume-transform-produce with the strongest mechanism the platform offers).
//!
//! Both process the messages of one partition in order and different partitions concurrently,
//! and commit a partition's position only when every message before it is finished (handled,
//! dead-lettered, or skipped as a duplicate).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::client::IDEMPOTENCY_KEY_HEADER;
use crate::error::{BoxError, Error, Result};
use crate::model::{Message, Record};

mod claims;
mod idempotent;
mod pipeline;
mod store_retry;
pub(crate) mod tracker;

pub use idempotent::{IdempotentConsumer, RunSummary};
pub use pipeline::{Pipeline, PipelineConfig, PipelineMode, Transform, TransformOutput};

/// A user function giving a message's idempotency key.
pub type KeyFn = Arc<dyn Fn(&Message) -> Option<String> + Send + Sync>;

/// Where the idempotency key of a message comes from.
#[derive(Clone)]
pub enum KeyStrategy {
    /// A header (default `idempotency-key`). A message without it (or with it empty) is
    /// *keyless*: with a dedup store it writes no dedup record and its handler runs
    /// at-least-once (counted in [`crate::MetricsSnapshot::keyless`]), or it is refused when
    /// [`EngineConfig::require_key`] is on. A requeued record's generation
    /// ([`crate::Record::requeue`]) is part of its dedup key.
    Header(String),
    /// The message's coordinates: `topic/partition/position`.
    Coordinates,
    /// A user function; `None` means "no key": the message is keyless, as for a missing
    /// header.
    Custom(KeyFn),
}

impl Default for KeyStrategy {
    fn default() -> Self {
        KeyStrategy::Header(IDEMPOTENCY_KEY_HEADER.to_string())
    }
}

impl std::fmt::Debug for KeyStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyStrategy::Header(h) => write!(f, "Header({h:?})"),
            KeyStrategy::Coordinates => f.write_str("Coordinates"),
            KeyStrategy::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl KeyStrategy {
    /// The idempotency key this strategy finds in `message`, or `None` when it finds none (a
    /// missing or empty header, a function returning `None`): the key the dedup store sees,
    /// without the requeue generation.
    pub fn find_key(&self, message: &Message) -> Option<String> {
        match self {
            KeyStrategy::Header(name) => match message.headers.get_any_case(name) {
                Some(Some(v)) if !v.is_empty() => Some(String::from_utf8_lossy(v).into_owned()),
                _ => None,
            },
            KeyStrategy::Coordinates => Some(coordinates(message)),
            KeyStrategy::Custom(f) => f(message),
        }
    }

    /// What found nothing in a keyless message, for error messages: `header 'NAME'` or `the
    /// key function`.
    pub fn source(&self) -> String {
        match self {
            KeyStrategy::Header(name) => format!("header '{name}'"),
            KeyStrategy::Coordinates => "the message coordinates".to_string(),
            KeyStrategy::Custom(_) => "the key function".to_string(),
        }
    }

    /// The idempotency key of `message` as output ids and the inbox use it: like
    /// [`KeyStrategy::find_key`], except that a message without the header falls back to its
    /// own coordinates (`@topic/partition/position`), so the outputs of its replays keep
    /// deterministic ids.
    pub fn key_of(&self, message: &Message) -> Option<String> {
        match self {
            KeyStrategy::Header(name) => match message.headers.get_any_case(name) {
                Some(Some(v)) if !v.is_empty() => Some(String::from_utf8_lossy(v).into_owned()),
                _ => Some(coordinates(message)),
            },
            KeyStrategy::Coordinates => Some(coordinates(message)),
            KeyStrategy::Custom(f) => f(message),
        }
    }
}

/// The text forms a setting takes in the CLI and the bindings: `header:NAME` or
/// `coordinates` (a [`KeyStrategy::Custom`] function has no text form).
/// Errors: [`crate::ErrorKind::Config`] naming the text.
impl std::str::FromStr for KeyStrategy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.strip_prefix("header:") {
            Some(name) if !name.is_empty() => Ok(KeyStrategy::Header(name.to_string())),
            _ if s == "coordinates" => Ok(KeyStrategy::Coordinates),
            _ => Err(Error::config(format!(
                "key strategy '{}': expected header:NAME (such as header:idempotency-key) or \
                 coordinates",
                crate::shown(s)
            ))),
        }
    }
}

/// The base of output ids for `m` (pipeline outputs are `{base}:{index}`): the strategy's key
/// ([`KeyStrategy::key_of`]) with the requeue generation, so the outputs of a requeued input
/// are new to the platform too; generation 0 leaves the key as it is.
pub(crate) fn output_key(key: &KeyStrategy, m: &Message) -> Option<String> {
    let k = key.key_of(m)?;
    Some(
        match m.headers.get_any_case(crate::model::KEY_GENERATION_HEADER) {
            Some(Some(g)) => crate::model::with_generation(k, g),
            _ => k,
        },
    )
}

/// The error for a keyless message when [`EngineConfig::require_key`] is on.
pub(crate) fn missing_key_error(key: &KeyStrategy, m: &Message) -> Error {
    Error::config(format!(
        "message at {}/{} position {} has no idempotency key: {} found none (require_key is \
         on; expected every message to carry a key)",
        m.topic,
        m.partition,
        m.position,
        key.source()
    ))
}

/// `@{topic}/{partition}/{position}`, the position in its `Display` form. Offsets and sequence
/// numbers are written without the formatting machinery: this key is built for every input of
/// a pipeline (an output's id) and `write!` was 7 % of the K4 loop's CPU time.
fn coordinates(m: &Message) -> String {
    use std::fmt::Write as _;
    // Room for the position and a `:N` output suffix, so neither reallocates.
    let mut s = String::with_capacity(m.topic.len() + 48);
    let mut digits = itoa::Buffer::new();
    s.push('@');
    s.push_str(&m.topic);
    s.push('/');
    s.push_str(digits.format(m.partition));
    s.push('/');
    match &m.position {
        crate::model::Position::Offset(o) => {
            s.push_str("offset:");
            s.push_str(digits.format(*o));
        }
        crate::model::Position::Sequence(q) => {
            s.push_str("seq:");
            s.push_str(digits.format(*q));
        }
        other => {
            let _ = write!(s, "{other}");
        }
    }
    s
}

/// What to do with a message whose handler still fails after the last retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnFailure {
    /// Send it to this dead-letter topic with the error in headers (`onceflow-error`,
    /// `onceflow-error-kind`, `onceflow-source-topic`, `onceflow-source-partition`,
    /// `onceflow-source-position`, `onceflow-attempts`), then treat it as finished.
    DeadLetter(String),
    /// Release its claim and ask the platform to deliver it again (nack; a rewind of the
    /// partition on platforms without per-message nack). Nothing is lost. The default.
    Redeliver,
    /// Release its claim and stop the consumer with the error (finished work is committed).
    Stop,
}

/// The text forms: `redeliver`, `stop` or `dead-letter:TOPIC`; [`std::fmt::Display`] writes
/// the same. Errors: [`crate::ErrorKind::Config`] naming the text.
impl std::str::FromStr for OnFailure {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "redeliver" => Ok(OnFailure::Redeliver),
            "stop" => Ok(OnFailure::Stop),
            _ => match s.strip_prefix("dead-letter:") {
                Some(topic) if !topic.is_empty() => Ok(OnFailure::DeadLetter(topic.to_string())),
                _ => Err(Error::config(format!(
                    "failure policy '{}': expected redeliver, stop or dead-letter:TOPIC",
                    crate::shown(s)
                ))),
            },
        }
    }
}

impl std::fmt::Display for OnFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OnFailure::DeadLetter(t) => write!(f, "dead-letter:{t}"),
            OnFailure::Redeliver => f.write_str("redeliver"),
            OnFailure::Stop => f.write_str("stop"),
        }
    }
}

/// Engine settings shared by [`IdempotentConsumer`] and [`Pipeline`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Where idempotency keys come from.
    pub key: KeyStrategy,
    /// Prefix of keys in the dedup store, so groups sharing a store do not see each other's
    /// keys. Default: the consumer group.
    pub namespace: Option<String>,
    /// This worker's identity for claims. A restarted worker with the same id takes over its
    /// own leases at once. Default: random per process.
    pub worker_id: String,
    /// Lease of a claim; renewed every third of it while the handler runs. Default 30 s.
    pub lease: Duration,
    /// Compare payload fingerprints: the same key with a different payload is an
    /// [`crate::ErrorKind::Conflict`] instead of a silent skip. Default on. A conflicting
    /// message never stops the engine by itself: it is routed like a handler that failed for
    /// good, by [`EngineConfig::on_failure`] (dead-lettered, redelivered, or a stop only when
    /// the policy is [`OnFailure::Stop`]). A conflict does not go away on redelivery: with
    /// [`OnFailure::Redeliver`] it comes back until the platform's delivery limit, so name a
    /// dead-letter topic.
    pub fingerprint: bool,
    /// Refuse keyless messages (no key found by [`EngineConfig::key`]): each is an
    /// [`crate::ErrorKind::Config`] error naming the header or the key function that found
    /// nothing, routed like a handler that failed for good (dead-letter topic, or
    /// [`EngineConfig::on_failure`]); its handler does not run. Default off: a keyless
    /// message runs at-least-once without a dedup record, counted in
    /// [`crate::MetricsSnapshot::keyless`].
    pub require_key: bool,
    /// Handler attempts per delivery (1 = no retry). Default 5.
    pub max_attempts: u32,
    /// First retry delay; doubles up to `max_backoff`, with jitter. Default 100 ms. Also the
    /// first wait after a retriable failure of a poll or of a dedup store call (the store's
    /// server restarting, a connection reset): those are waited out and made again, for as
    /// long as they last, instead of ending the run.
    pub min_backoff: Duration,
    /// Longest retry delay (handler retries, polls and dedup store calls). Default 5 s.
    pub max_backoff: Duration,
    /// What to do when retries are exhausted.
    pub on_failure: OnFailure,
    /// Delay asked of the platform for a redelivery. Default 1 s.
    pub redelivery_delay: Duration,
    /// Messages per poll. Default 500.
    pub batch_size: usize,
    /// Longest wait for a poll. Default 100 ms.
    pub poll_timeout: Duration,
    /// Commit finished positions at least this often. Default 1 s.
    pub commit_interval: Duration,
    /// ... or after this many finished messages. Default 10 000.
    pub commit_every: u64,
    /// On shutdown, time allowed to finish work in flight. Default 30 s.
    pub shutdown_deadline: Duration,
    /// Trace every message (extract context, `process` span). Default on.
    pub tracing: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            key: KeyStrategy::default(),
            namespace: None,
            worker_id: format!("worker-{:016x}", rand::random::<u64>()),
            lease: Duration::from_secs(30),
            fingerprint: true,
            require_key: false,
            max_attempts: 5,
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            on_failure: OnFailure::Redeliver,
            redelivery_delay: Duration::from_secs(1),
            batch_size: 500,
            poll_timeout: Duration::from_millis(100),
            commit_interval: Duration::from_secs(1),
            commit_every: 10_000,
            shutdown_deadline: Duration::from_secs(30),
            tracing: true,
        }
    }
}

impl EngineConfig {
    /// Checks the settings; [`crate::ErrorKind::Config`] naming the bad value.
    pub fn validate(&self) -> Result<()> {
        if self.max_attempts == 0 {
            return Err(Error::config("max_attempts is 0: expected at least 1"));
        }
        if self.batch_size == 0 {
            return Err(Error::config("batch_size is 0: expected at least 1"));
        }
        if self.lease < Duration::from_millis(100) {
            return Err(Error::config(format!(
                "lease {:?} is too short: expected at least 100 ms",
                self.lease
            )));
        }
        if self.worker_id.is_empty() {
            return Err(Error::config("worker_id is empty: expected an identifier"));
        }
        if let OnFailure::DeadLetter(t) = &self.on_failure {
            if t.is_empty() {
                return Err(Error::config(
                    "dead-letter topic is empty: expected a topic name",
                ));
            }
        }
        Ok(())
    }

    /// How long to wait before asking the store again for a key another worker holds, after
    /// `asked` earlier asks: 20 ms doubling to at most 500 ms, never past the holder's lease
    /// (`expires_in`) nor a third of ours. So a completion or release by the holder is noticed
    /// within half a second (it used to take up to a third of the lease, 10 s by default),
    /// and a long-held key costs two store reads a second.
    pub(crate) fn claim_wait(&self, expires_in: Duration, asked: u32) -> Duration {
        const FIRST: Duration = Duration::from_millis(20);
        const LONGEST: Duration = Duration::from_millis(500);
        let step = FIRST.saturating_mul(1 << asked.min(5)).min(LONGEST);
        expires_in
            .min(self.lease / 3)
            .min(step)
            .max(Duration::from_millis(10))
    }

    pub(crate) fn backoff(&self) -> impl Iterator<Item = Duration> {
        use backon::BackoffBuilder;
        backon::ExponentialBuilder::default()
            .with_min_delay(self.min_backoff)
            .with_max_delay(self.max_backoff)
            .with_jitter()
            .with_max_times(self.max_attempts.saturating_sub(1) as usize)
            .build()
    }
}

/// A message handler for [`IdempotentConsumer`].
#[async_trait]
pub trait Handler: Send + Sync {
    /// Handles one message. The returned bytes, if any, are stored with the completed key and
    /// given to [`Handler::on_duplicate`] for later duplicates. An error is retried with backoff
    /// (see [`EngineConfig::max_attempts`]).
    async fn handle(&self, message: &Message) -> std::result::Result<Option<Bytes>, BoxError>;

    /// Called for a message skipped as a duplicate, with the result stored by the first run.
    async fn on_duplicate(&self, message: &Message, result: Option<Bytes>) {
        let _ = (message, result);
    }

    /// Whether [`IdempotentConsumer`] hands this handler runs of messages through
    /// [`Handler::handle_batch`] instead of one [`Handler::handle`] call per message (for
    /// handlers with a per-call cost, such as a call into another language). Default: `false`.
    fn batched(&self) -> bool {
        false
    }

    /// Handles consecutive messages of one partition, in order, in one call; used instead of
    /// [`Handler::handle`] when [`Handler::batched`] is `true`. Every message given is claimed
    /// (or has no idempotency key); duplicates never reach it.
    ///
    /// `Ok` holds one result per message, in order, each stored with its completed key like
    /// the result of [`Handler::handle`] (a count that differs from `messages.len()` is a
    /// non-retriable handler error). An `Err` fails the whole call: it is retried with backoff
    /// like a failing `handle` (see [`EngineConfig::max_attempts`]); when the retries are
    /// exhausted, each message of the call is given up in order, as a failing `handle` would
    /// be (claim released, then [`EngineConfig::on_failure`]), so none is lost.
    ///
    /// Default: [`Handler::handle`] on each message in turn, stopping at the first error.
    async fn handle_batch(
        &self,
        messages: &[Message],
    ) -> std::result::Result<Vec<Option<Bytes>>, BoxError> {
        let mut out = Vec::with_capacity(messages.len());
        for m in messages {
            out.push(self.handle(m).await?);
        }
        Ok(out)
    }
}

type HandlerFuture =
    Pin<Box<dyn Future<Output = std::result::Result<Option<Bytes>, BoxError>> + Send>>;

/// Adapts a closure taking an owned [`Message`] into a [`Handler`].
pub fn handler_fn<F, Fut>(f: F) -> impl Handler
where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<Option<Bytes>, BoxError>> + Send + 'static,
{
    struct FnHandler<F>(F);
    #[async_trait]
    impl<F> Handler for FnHandler<F>
    where
        F: Fn(Message) -> HandlerFuture + Send + Sync,
    {
        async fn handle(&self, message: &Message) -> std::result::Result<Option<Bytes>, BoxError> {
            (self.0)(message.clone()).await
        }
    }
    FnHandler(move |m: Message| -> HandlerFuture { Box::pin(f(m)) })
}

/// Builds the dead-letter record for `message` that failed with `error` after `attempts`.
pub(crate) fn dead_letter_record(
    topic: &str,
    message: &Message,
    error: &Error,
    attempts: u32,
) -> Record {
    let mut r = Record {
        topic: topic.to_string(),
        key: message.key.clone(),
        payload: message.payload.clone(),
        headers: message.headers.clone(),
        ..Default::default()
    };
    r.headers
        .set("onceflow-error", error.to_string().into_bytes())
        .set(
            "onceflow-error-kind",
            error.kind().code().as_bytes().to_vec(),
        )
        .set("onceflow-source-topic", message.topic.clone().into_bytes())
        .set(
            "onceflow-source-partition",
            message.partition.to_string().into_bytes(),
        )
        .set(
            "onceflow-source-position",
            message.position.to_string().into_bytes(),
        )
        .set("onceflow-attempts", attempts.to_string().into_bytes());
    r
}

#[cfg(test)]
mod claim_wait_tests {
    use super::*;

    #[test]
    fn a_held_key_is_asked_for_again_within_half_a_second_and_never_past_its_lease() {
        let c = EngineConfig::default();
        let long = Duration::from_secs(30);
        let waits: Vec<_> = (0..8).map(|n| c.claim_wait(long, n)).collect();
        assert_eq!(waits[0], Duration::from_millis(20));
        assert_eq!(waits[3], Duration::from_millis(160));
        assert!(
            waits.iter().all(|w| *w <= Duration::from_millis(500)),
            "{waits:?}"
        );
        assert_eq!(waits[7], Duration::from_millis(500));
        assert_eq!(
            c.claim_wait(Duration::from_millis(50), 9),
            Duration::from_millis(50)
        );
        assert_eq!(c.claim_wait(Duration::ZERO, 0), Duration::from_millis(10));
    }
}

#[cfg(test)]
mod text_form_tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn settings_parse_from_their_text_forms_and_display_back() {
        assert!(matches!(
            "header:idem".parse::<KeyStrategy>(),
            Ok(KeyStrategy::Header(h)) if h == "idem"
        ));
        assert!(matches!(
            "coordinates".parse::<KeyStrategy>(),
            Ok(KeyStrategy::Coordinates)
        ));
        for text in ["redeliver", "stop", "dead-letter:orders.dlq"] {
            assert_eq!(text.parse::<OnFailure>().unwrap().to_string(), text);
        }
        for text in ["auto", "transactional", "idempotent"] {
            assert_eq!(text.parse::<PipelineMode>().unwrap().to_string(), text);
        }
    }

    #[test]
    fn a_bad_text_form_is_a_config_error_naming_it_and_the_accepted_ones() {
        for (err, named, accepted) in [
            (
                "header:".parse::<KeyStrategy>().unwrap_err(),
                "'header:'",
                "coordinates",
            ),
            (
                "coords".parse::<KeyStrategy>().unwrap_err(),
                "'coords'",
                "header:NAME",
            ),
            (
                "dead-letter:".parse::<OnFailure>().unwrap_err(),
                "'dead-letter:'",
                "redeliver",
            ),
            (
                "retry".parse::<OnFailure>().unwrap_err(),
                "'retry'",
                "dead-letter:TOPIC",
            ),
            (
                "exactly".parse::<PipelineMode>().unwrap_err(),
                "'exactly'",
                "transactional",
            ),
        ] {
            assert_eq!(err.kind(), ErrorKind::Config);
            assert!(err.message().contains(named), "{}", err.message());
            assert!(err.message().contains(accepted), "{}", err.message());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Position;

    #[test]
    fn coordinates_write_the_position_in_its_display_form() {
        let positions = [
            Position::Offset(0),
            Position::Offset(i64::MAX),
            Position::Offset(-1),
            Position::Sequence(u64::MAX),
            Position::SequenceNumber(
                "49590338271490256608559692538361571095921575989136588898".into(),
            ),
            Position::MessageId {
                ledger: 7,
                entry: 3,
                partition: -1,
                batch: 2,
            },
        ];
        for (i, position) in positions.into_iter().enumerate() {
            let m = Message {
                topic: "orders.eu".into(),
                partition: i as i32 - 1,
                position,
                key: None,
                payload: Default::default(),
                headers: Default::default(),
                timestamp: None,
                delivery_count: 1,
            };
            assert_eq!(
                coordinates(&m),
                format!("@{}/{}/{}", m.topic, m.partition, m.position)
            );
        }
    }
}
