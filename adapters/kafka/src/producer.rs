//! The producer: rdkafka's `ThreadedProducer` (its own poll thread serves delivery reports),
//! idempotent by default, transactional with a `transactional.id` (KIP-98, KIP-447).
//!
//! Delivery reports: every call enqueues its records with one shared `Reports` (one 32-byte
//! slot per record, a pointer to it as librdkafka's per-message opaque), the poll thread's
//! delivery callback fills the slots, and the caller is woken once, when the last report is in.
//! `FutureProducer` instead gives each record its own oneshot channel and future. That path,
//! with every `unsafe` it needs and the invariants they rely on, is the `batch` module.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::{
    backend::DeliveriesFuture, Capabilities, Delivery, Error, ErrorKind, GroupMetadata, Position,
    ProducerBackend, ProducerConfig, Record, Result, TopicPartition, TransactionBackend,
};
use parking_lot::Mutex;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{Producer, ThreadedProducer};
use rdkafka::{Offset, TopicPartitionList};

use crate::config::{KafkaConfig, BROKER_DEFAULT_MESSAGE_MAX_BYTES, RECORD_FRAMING_MAX};
use crate::consumer::KafkaGroupMetadata;
use crate::errors;
use crate::CAPABILITIES;

mod batch;
use batch::{enqueue_all, send_on, Enqueued, ReportContext};

type NativeProducer = ThreadedProducer<ReportContext>;
type Native = Arc<NativeProducer>;

#[derive(Default)]
struct TxnState {
    /// `init_transactions` succeeded on the current native producer.
    initialized: bool,
    /// The next transaction needs a fresh native producer (after an unknown commit outcome, a
    /// fatal error, or a transaction dropped while open).
    needs_reinit: bool,
    /// Why this producer is fenced, once it is: it never writes again.
    fenced: Option<String>,
    /// A transaction is open.
    open: bool,
}

struct Shared {
    kafka: KafkaConfig,
    transactional_id: Option<String>,
    native_config: rdkafka::ClientConfig,
    native: Mutex<Native>,
    /// The producer's `linger.ms` (see [`send_all_on`]).
    linger: Duration,
    /// What [`check_size`] checks records against.
    limits: SizeLimits,
    state: Mutex<TxnState>,
    /// Serialises `begin` (initialisation and re-creation of the native producer).
    init_lock: tokio::sync::Mutex<()>,
    /// A [`flush_queued_once`] is running: it covers whatever is enqueued meanwhile too.
    flushing: Arc<AtomicBool>,
}

/// A Kafka producer. Cheap to share; every send waits for its delivery report.
pub struct KafkaProducer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for KafkaProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaProducer")
            .field("bootstrap_servers", &self.shared.kafka.bootstrap_servers)
            .field("transactional_id", &self.shared.transactional_id)
            .finish()
    }
}

fn create_native(config: &rdkafka::ClientConfig) -> Result<Native> {
    config
        .create_with_context::<_, NativeProducer>(ReportContext)
        .map(Arc::new)
        .map_err(|e| errors::map(e, "creating the Kafka producer"))
}

/// Drops a native producer off the executor (librdkafka's destroy can block while it flushes).
fn drop_native(native: Native) {
    if let Ok(h) = tokio::runtime::Handle::try_current() {
        h.spawn_blocking(move || drop(native));
    }
}

/// The error of a record of `topic` that librdkafka refused or failed.
fn send_error(e: KafkaError, topic: &str) -> Error {
    errors::map(e, format_args!("send to topic '{topic}'"))
}

fn headers_of(record: &Record) -> Option<OwnedHeaders> {
    if record.headers.is_empty() {
        return None;
    }
    let mut h = OwnedHeaders::new_with_capacity(record.headers.len());
    for header in record.headers.iter() {
        h = h.insert(Header {
            key: header.name.as_str(),
            value: header.value.as_deref(),
        });
    }
    Some(h)
}

/// The size limits a record is checked against before it is handed to librdkafka.
#[derive(Debug, Clone, Copy)]
struct SizeLimits {
    /// The connection's largest record (key + payload + headers), [`KafkaConfig::max_record_bytes`].
    record: usize,
    /// The producer's `message.max.bytes`, which librdkafka compares with [`wire_size`].
    wire: usize,
    /// `wire` is onceflow's default (no `message.max.bytes` on the URL or in the options).
    wire_is_default: bool,
}

impl SizeLimits {
    /// The limits of a producer of `kafka` with `options`, whose native configuration is
    /// `native_config`. [`ErrorKind::Config`] when `options` raise `message.max.bytes` above
    /// the connection's: the record limit is the connection's (it is checked before a record
    /// reaches the producer), so a larger one belongs on the URL.
    fn of(
        kafka: &KafkaConfig,
        options: &std::collections::BTreeMap<String, String>,
        native_config: &rdkafka::ClientConfig,
    ) -> Result<SizeLimits> {
        let wire = native_config
            .get("message.max.bytes")
            .and_then(librdkafka_int)
            .unwrap_or(usize::MAX);
        if let Some(v) = options.get("message.max.bytes") {
            crate::config::message_max_bytes(v, "in the producer's options")?;
            // What the connection alone gives librdkafka (its own value, else the default).
            let connection = kafka
                .client_config(&Default::default())
                .get("message.max.bytes")
                .and_then(librdkafka_int)
                .unwrap_or(usize::MAX);
            if wire > connection {
                return Err(Error::config(format!(
                    "message.max.bytes '{v}' in the producer's options is above the connection's \
                     {connection}: expected it on the URL (kafka://…?message.max.bytes={wire}), \
                     where onceflow's record size check reads it too"
                )));
            }
        }
        Ok(SizeLimits {
            record: kafka.max_record_bytes,
            wire,
            wire_is_default: !kafka.is_set("message.max.bytes", options),
        })
    }
}

/// An integer property as librdkafka reads it (`strtol(value, &end, 0)` in `rdkafka_conf.c`):
/// leading white space skipped, an optional sign, `0x` for hex, a leading `0` for octal, and
/// anything after the digits ignored, the result cut to a C `int`. `None` when no digit comes
/// first (librdkafka refuses the value then) or the value is negative (below every limit
/// librdkafka allows).
fn librdkafka_int(v: &str) -> Option<usize> {
    let v = v.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let (negative, v) = match v.as_bytes().first() {
        Some(b'-') => (true, &v[1..]),
        Some(b'+') => (false, &v[1..]),
        _ => (false, v),
    };
    let (radix, digits) = match v.as_bytes() {
        [b'0', b'x' | b'X', h, ..] if h.is_ascii_hexdigit() => (16, &v[2..]),
        [b'0', ..] => (8, v),
        _ => (10, v),
    };
    let end = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    if end == 0 || negative {
        return None;
    }
    // `strtol` stops at LONG_MAX, then librdkafka keeps the low 32 bits (`(int)strtol(…)`):
    // 4294987296 is 20000 to it.
    let long = u64::from_str_radix(&digits[..end], radix)
        .map_or(i64::MAX, |n| n.min(i64::MAX as u64) as i64);
    usize::try_from(long as i32).ok()
}

/// Bytes of `n` as a zigzag varint (Kafka's record format v2, KIP-98).
fn zigzag_varint_len(n: usize) -> usize {
    let mut z = (n as u64) << 1;
    let mut len = 1;
    while z >= 0x80 {
        z >>= 7;
        len += 1;
    }
    len
}

/// The size librdkafka compares with `message.max.bytes` when a record is produced
/// (`rd_kafka_msg_max_wire_size`, librdkafka `rdkafka_msg.h`): [`RECORD_FRAMING_MAX`] + key +
/// payload + each header's name and value with their varint lengths (`rd_kafka_header_add`).
fn wire_size(record: &Record) -> usize {
    let headers: usize = record
        .headers
        .iter()
        .map(|h| {
            let value = h.value.as_deref().map_or(0, <[u8]>::len);
            h.name.len() + value + zigzag_varint_len(h.name.len()) + zigzag_varint_len(value)
        })
        .sum();
    RECORD_FRAMING_MAX + record.key.as_ref().map_or(0, |k| k.len()) + record.payload.len() + headers
}

/// Refuses a record larger than the connection's limit, or one that librdkafka would refuse
/// for `message.max.bytes` once framed, naming both sizes and the limit.
fn check_size(record: &Record, limits: SizeLimits) -> Result<()> {
    let size = record.size_bytes();
    let max = limits.record;
    if size > max {
        return Err(Error::config(format!(
            "record of {size} bytes (key + payload + headers) for topic '{}' exceeds the limit of \
             {max} bytes (message.max.bytes): expected at most {max}",
            record.topic
        )));
    }
    let wire = wire_size(record);
    if wire > limits.wire {
        let default = if limits.wire_is_default {
            format!(
                " (onceflow's default: what fits in a default broker's message.max.bytes of \
                 {BROKER_DEFAULT_MESSAGE_MAX_BYTES}; a larger one goes on the URL, \
                 kafka://…?message.max.bytes=N, with the topic's max.message.bytes)"
            )
        } else {
            String::new()
        };
        return Err(Error::config(format!(
            "record of {size} bytes (key + payload + headers) for topic '{}' is {wire} bytes with \
             librdkafka's record framing, over message.max.bytes = {}{default}: expected at \
             most {} bytes with framing ({RECORD_FRAMING_MAX} of framing plus each header's \
             lengths)",
            record.topic, limits.wire, limits.wire
        )));
    }
    Ok(())
}

/// librdkafka's `linger.ms` (alias `queue.buffering.max.ms`) in `config`, or its default of
/// 5 ms (librdkafka ≥ 2.0, CONFIGURATION.md).
fn linger_of(config: &rdkafka::ClientConfig) -> Duration {
    config
        .get("linger.ms")
        .or_else(|| config.get("queue.buffering.max.ms"))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|ms| Duration::try_from_secs_f64(ms / 1000.0).ok())
        .unwrap_or(Duration::from_millis(5))
}

/// Sends what is queued now rather than after `linger.ms`, for at most `window` (the linger
/// time, after which it would leave anyway): `rd_kafka_flush` with a timeout sets librdkafka's
/// "flushing" flag, under which the broker threads treat `linger.ms` as elapsed, and wakes
/// them; it returns when nothing is outstanding or `window` has passed. This is Java's
/// `KafkaProducer.flush()` made non-blocking for the caller: it runs on a blocking thread and
/// nobody waits for it. rust-rdkafka's `Producer::flush` cannot be used: it calls
/// `rd_kafka_flush` with a zero timeout and then polls, so the flag is gone before a broker
/// thread wakes up and the records still wait `linger.ms`.
fn flush_queued(native: Native, window: Duration) {
    tokio::task::spawn_blocking(move || flush_blocking(&native, window));
}

/// `rd_kafka_flush(window)` on the calling (blocking) thread; see [`flush_queued`].
#[allow(unsafe_code)]
fn flush_blocking(native: &Native, window: Duration) {
    let ms = i32::try_from(window.as_millis()).unwrap_or(i32::MAX).max(1);
    // SAFETY: `native_ptr` is the rd_kafka_t owned by `native`, which the caller keeps alive
    // for the call. `rd_kafka_flush` may be called from any thread; with the event based
    // delivery reports rust-rdkafka configures, it only waits for the outstanding message
    // count (it serves no queue), so the producer's own poll thread still receives every
    // delivery report. Its result (timed out or not) needs no handling: the delivery reports
    // carry each record's outcome.
    unsafe { rdkafka::bindings::rd_kafka_flush(native.client().native_ptr(), ms) };
}

/// Starts the idempotent producer's ProducerID acquisition now rather than after 500 ms.
///
/// librdkafka (2.12) asks for a ProducerID (KIP-98 `InitProducerId`) from a 500 ms timer it
/// starts when the producer is created, and also whenever a metadata response arrives
/// (`rdkafka_idempotence.c`, `rdkafka_metadata.c`). The first response usually comes over the
/// bootstrap connection, before the broker it names is connected; no broker is then eligible,
/// so the request waits for the timer, and every record sent meanwhile waits with it: the
/// first delivery of a new idempotent producer took ~505 ms on a loopback broker, against
/// ~5 ms without idempotence (librdkafka PR #5032 works on the same first-produce delay). A
/// transactional producer's `init_transactions` waited for the same timer about one time in two
/// (~506 ms instead of ~58 ms to a ready producer in K4, and again at every re-initialisation
/// after a fencing or an unknown commit outcome), so it is primed too. Two
/// metadata requests for no topic, one after the other, on a blocking thread: the second is
/// answered by a broker learned from the first, once it is up, and its response acquires the
/// ProducerID then (~55 ms). Nobody waits for them; a failure (broker down) leaves the timer
/// in charge, as before.
#[allow(unsafe_code)]
fn acquire_producer_id_early(native: &Native, timeout: Duration) {
    let native = native.clone();
    let ms = i32::try_from(timeout.min(PRIME_TIMEOUT).as_millis())
        .unwrap_or(i32::MAX)
        .max(1);
    tokio::task::spawn_blocking(move || {
        for _ in 0..2 {
            let mut md: *const rdkafka::bindings::rd_kafka_metadata_t = std::ptr::null();
            // SAFETY: the rd_kafka_t is owned by `native`, alive for the call. With
            // `all_topics` 0 and no topic handle, librdkafka asks for the topics it knows
            // locally (none for a new producer): a brokers-only request. On success it hands
            // over `md`, freed right away with `rd_kafka_metadata_destroy`.
            let err = unsafe {
                rdkafka::bindings::rd_kafka_metadata(
                    native.client().native_ptr(),
                    0,
                    std::ptr::null_mut(),
                    &mut md,
                    ms,
                )
            };
            if !md.is_null() {
                // SAFETY: `md` came from `rd_kafka_metadata` above and is freed once.
                unsafe { rdkafka::bindings::rd_kafka_metadata_destroy(md) };
            }
            if err != rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
                return;
            }
        }
    });
}

/// Bound of each metadata request of [`acquire_producer_id_early`].
const PRIME_TIMEOUT: Duration = Duration::from_secs(10);

/// `commit_transaction` without rust-rdkafka's up-to-100 ms stall.
///
/// rust-rdkafka's `commit_transaction` first runs its own `flush`: `rd_kafka_flush` with a zero
/// timeout, and while records are outstanding, a `poll` of the main queue for up to 100 ms on
/// the calling thread. Here the producer's poll thread serves that queue, and a record counts
/// as outstanding until that thread has released its delivery report, which it does just
/// after our callback woke the caller: when the commit came first, its poll found no event
/// (the poll thread had taken it) and waited the whole 100 ms. That was 2 of ~24 commits in a
/// K3 run (and the K3 figure with them). `rd_kafka_flush` with the real timeout first instead
/// waits on librdkafka's condition variable for the count to reach zero (event mode: it serves
/// no queue, see [`flush_blocking`]), so rust-rdkafka's flush then returns at once.
fn commit_blocking(native: &Native, timeout: Duration) -> std::result::Result<(), KafkaError> {
    flush_blocking(native, timeout);
    native.commit_transaction(timeout)
}

/// `abort_transaction` once the records in flight are delivered (or `timeout` passed).
///
/// Aborting with records still in flight raced librdkafka's partition registration: when the
/// transaction's `AddPartitionsToTxn` had met the previous transaction's markers
/// (`CONCURRENT_TRANSACTIONS`) and waited for its retry, librdkafka 2.12 sent `EndTxn(ABORT)`
/// to a coordinator still in `CompleteCommit`, which refused it as `INVALID_TXN_STATE`, a fatal
/// error (1 abort in 4 right after an unawaited `enqueue_batch` on the test broker). A record
/// is only delivered once its partition is registered, so after [`flush_blocking`] the
/// coordinator holds the transaction open and the abort ends it; the delivered records are
/// aborted with it and never visible to a read_committed reader.
fn abort_blocking(native: &Native, timeout: Duration) -> std::result::Result<(), KafkaError> {
    flush_blocking(native, timeout);
    native.abort_transaction(timeout)
}

/// How much longer than librdkafka's own timeout a transaction API call may take before
/// onceflow stops waiting for it.
const TXN_CALL_GRACE: Duration = Duration::from_secs(5);

/// Runs a blocking transaction API call (`what`, given librdkafka's `timeout`) on a thread of
/// its own and waits for it at most `timeout` + [`TXN_CALL_GRACE`]. librdkafka does not always
/// honour its own timeout there: with the group coordinator's broker killed,
/// `send_offsets_to_transaction` waited for good on a coordinator that left the metadata
/// (librdkafka #5511, #5456; `docs/reliability.md`), and the pipeline never failed nor went
/// on. Past the bound this is a retriable `Timeout` and the producer is marked to be re-created
/// for the next transaction (a fresh one's `init_transactions` fences the stuck one, KIP-98);
/// the stuck call keeps its thread until librdkafka returns, without holding up the runtime's
/// shutdown.
async fn bounded<T: Send + 'static>(
    shared: &Shared,
    what: &str,
    timeout: Duration,
    call: impl FnOnce() -> std::result::Result<T, KafkaError> + Send + 'static,
) -> Result<std::result::Result<T, KafkaError>> {
    let bound = timeout.saturating_add(TXN_CALL_GRACE);
    // A thread of its own, not the runtime's blocking pool: a runtime waits for its blocking
    // tasks when it shuts down, so a call librdkafka never returns kept the process from
    // exiting (the fault test passed, then hung at its end).
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name(format!("onceflow-kafka-{what}"))
        .spawn(move || {
            let _ = tx.send(call());
        });
    if let Err(e) = spawned {
        return Err(Error::new(
            ErrorKind::Platform,
            format!("{what}: could not start its thread: {e}"),
        ));
    }
    match tokio::time::timeout(bound, rx).await {
        Ok(Ok(result)) => Ok(result),
        Ok(Err(_)) => Err(Error::new(
            ErrorKind::Platform,
            format!("{what}: its thread ended without an answer (it panicked)"),
        )),
        Err(_) => {
            shared.state.lock().needs_reinit = true;
            tracing::warn!(
                call = what,
                waited_ms = bound.as_millis() as u64,
                "librdkafka's transaction call did not return within its timeout; the producer is re-created for the next transaction"
            );
            Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "{what} did not return within {} ms (librdkafka's timeout {} ms + {} s);                      the producer is re-created for the next transaction",
                    bound.as_millis(),
                    timeout.as_millis(),
                    TXN_CALL_GRACE.as_secs()
                ),
            )
            .retriable(true))
        }
    }
}

/// [`flush_queued`] unless one started by this function is still running (`rd_kafka_flush`
/// keeps linger.ms off until nothing is outstanding, records enqueued meanwhile included), so
/// awaiting many enqueued batches in a row starts one flush, not one per batch.
fn flush_queued_once(shared: &Arc<Shared>, native: Native) {
    if shared.flushing.swap(true, Ordering::AcqRel) {
        return;
    }
    let flag = shared.flushing.clone();
    let window = shared.linger;
    tokio::task::spawn_blocking(move || {
        flush_blocking(&native, window);
        flag.store(false, Ordering::Release);
    });
}

/// The reports of records an `enqueue_batch` enqueued. Polled, the caller waits for them now,
/// so no later batch joins them: what is queued leaves at once ([`flush_queued_once`])
/// instead of after `linger.ms`.
async fn reports_of(
    shared: Arc<Shared>,
    native: Native,
    enqueued: Enqueued,
    records: Vec<Record>,
) -> Vec<Result<Delivery>> {
    if !shared.linger.is_zero() && enqueued.any_enqueued(records.len()) {
        flush_queued_once(&shared, native);
    }
    enqueued.delivered(records).await
}

/// `e` as the result of each of `records`.
fn each_failed(records: &[Record], e: &Error) -> Vec<Result<Delivery>> {
    let msg = e.to_string();
    records
        .iter()
        .map(|_| Err(Error::new(e.kind(), msg.clone())))
        .collect()
}

/// Sends `records` pipelined: every record is enqueued first, in order (librdkafka batches
/// them per partition and the idempotent producer keeps their order), then every delivery
/// report is awaited. One result per record, in input order.
///
/// A batch call hands over every record it has and waits for their reports, so waiting
/// `linger.ms` for more records to join them only adds latency (with one call in flight, each
/// call paid the whole 5 ms default). Once the batch is enqueued it is sent right away
/// ([`flush_queued`] for `linger`, the configured `linger.ms`; nothing when that is 0).
/// `linger.ms` still batches single `send` calls, and [`TransactionBackend::enqueue_batch`]
/// until its reports are awaited.
async fn send_all_on(
    native: &Native,
    records: Vec<Record>,
    limits: SizeLimits,
    linger: Duration,
) -> Vec<Result<Delivery>> {
    let enqueued = enqueue_all(native, &records, limits).await;
    if !linger.is_zero() && enqueued.any_enqueued(records.len()) {
        flush_queued(native.clone(), linger);
    }
    enqueued.delivered(records).await
}

fn run_blocking_err(e: KafkaError, what: &str) -> Error {
    errors::map(e, what)
}

fn is_producer_fenced(err: &KafkaError) -> bool {
    matches!(
        err.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::Fenced
                | RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
        )
    ) || matches!(err, KafkaError::Transaction(t) if matches!(t.code(),
            RDKafkaErrorCode::Fenced | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch))
}

fn is_fatal(err: &KafkaError) -> bool {
    matches!(err, KafkaError::Transaction(t) if t.is_fatal())
}

impl KafkaProducer {
    pub(crate) async fn new(kafka: KafkaConfig, config: ProducerConfig) -> Result<KafkaProducer> {
        let mut native_config = kafka.client_config(&config.options);
        if let Some(id) = &config.client_id {
            if !kafka.is_set("client.id", &config.options) {
                native_config.set("client.id", id);
            }
        }
        let transactional = config.transactional_id.is_some();
        if let Some(id) = &config.transactional_id {
            if id.is_empty() {
                return Err(Error::config(
                    "transactional id is empty: expected a non-empty id or None",
                ));
            }
            native_config.set("transactional.id", id);
        }
        if config.idempotent == Some(false) && transactional {
            return Err(Error::config(format!(
                "producer with transactional id '{}' and idempotent = false: Kafka \
                 transactions need the idempotent producer",
                config.transactional_id.as_deref().unwrap_or_default()
            )));
        }
        if native_config
            .get("delivery.report.only.error")
            .is_some_and(|v| v.eq_ignore_ascii_case("true"))
        {
            return Err(Error::config(
                "delivery.report.only.error=true: expected false (the default): onceflow waits \
                 for every record's delivery report, which librdkafka would then send only for \
                 failed records, so a successful send would never return",
            ));
        }
        if !kafka.is_set("enable.idempotence", &config.options) {
            let on = config.idempotent.unwrap_or(true) || transactional;
            native_config.set("enable.idempotence", if on { "true" } else { "false" });
        }
        let limits = SizeLimits::of(&kafka, &config.options, &native_config)?;
        let native = create_native(&native_config)?;
        let idempotent = native_config
            .get("enable.idempotence")
            .is_some_and(|v| v.eq_ignore_ascii_case("true"));
        if idempotent {
            acquire_producer_id_early(&native, kafka.timeout);
        }
        let producer = KafkaProducer {
            shared: Arc::new(Shared {
                limits,
                kafka,
                transactional_id: config.transactional_id,
                linger: linger_of(&native_config),
                native_config,
                native: Mutex::new(native),
                state: Mutex::new(TxnState::default()),
                init_lock: tokio::sync::Mutex::new(()),
                flushing: Arc::new(AtomicBool::new(false)),
            }),
        };
        if transactional {
            // KIP-98: once per producer, at creation, so a new producer fences an older one
            // with the same transactional id right away.
            ensure_initialized(&producer.shared).await?;
        }
        Ok(producer)
    }

    fn native(&self) -> Native {
        self.shared.native.lock().clone()
    }

    fn check_plain_send(&self) -> Result<()> {
        if let Some(id) = &self.shared.transactional_id {
            let st = self.shared.state.lock();
            if let Some(why) = &st.fenced {
                return Err(Error::new(ErrorKind::Fenced, why.clone()));
            }
            if !st.open {
                return Err(Error::config(format!(
                    "send on transactional producer '{id}' outside a transaction: expected \
                     begin() first (a transactional producer writes only inside transactions)"
                )));
            }
        }
        Ok(())
    }
}

/// Initialises transactions on the current native producer, re-creating it first when the
/// previous transaction left it in an unknown or fatal state.
async fn ensure_initialized(shared: &Shared) -> Result<Native> {
    let id = shared.transactional_id.clone().unwrap_or_default();
    let _guard = shared.init_lock.lock().await;
    let (initialized, reinit) = {
        let st = shared.state.lock();
        if let Some(why) = &st.fenced {
            return Err(Error::new(ErrorKind::Fenced, why.clone()));
        }
        (st.initialized, st.needs_reinit)
    };
    if initialized && !reinit {
        return Ok(shared.native.lock().clone());
    }
    if reinit {
        let fresh = create_native(&shared.native_config)?;
        acquire_producer_id_early(&fresh, shared.kafka.timeout);
        let old = std::mem::replace(&mut *shared.native.lock(), fresh);
        drop_native(old);
        let mut st = shared.state.lock();
        st.initialized = false;
        st.needs_reinit = false;
    }
    let native = shared.native.lock().clone();
    let timeout = shared.kafka.timeout;
    let n = native.clone();
    let res = tokio::task::spawn_blocking(move || n.init_transactions(timeout))
        .await
        .map_err(|e| errors::join(e, "init_transactions"))?;
    match res {
        Ok(()) => {
            shared.state.lock().initialized = true;
            Ok(native)
        }
        Err(e) => {
            let what = format!("init_transactions for transactional id '{id}'");
            if is_producer_fenced(&e) {
                shared.state.lock().fenced = Some(format!("{what}: fenced: {e}"));
            } else if is_fatal(&e) {
                shared.state.lock().needs_reinit = true;
            }
            Err(errors::map(e, what))
        }
    }
}

#[async_trait]
impl ProducerBackend for KafkaProducer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    async fn send(&self, record: Record) -> Result<Delivery> {
        self.check_plain_send()?;
        let native = self.native();
        send_on(&native, record, self.shared.limits).await
    }

    async fn send_batch(&self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        if let Err(e) = self.check_plain_send() {
            return each_failed(&records, &e);
        }
        let native = self.native();
        send_all_on(&native, records, self.shared.limits, self.shared.linger).await
    }

    async fn enqueue_batch(&self, records: Vec<Record>) -> DeliveriesFuture {
        if let Err(e) = self.check_plain_send() {
            return Box::pin(std::future::ready(each_failed(&records, &e)));
        }
        let native = self.native();
        let enqueued = enqueue_all(&native, &records, self.shared.limits).await;
        Box::pin(reports_of(self.shared.clone(), native, enqueued, records))
    }

    async fn begin(&self) -> Result<Box<dyn TransactionBackend>> {
        let Some(id) = self.shared.transactional_id.clone() else {
            return Err(Error::config(
                "begin() on a producer without a transactional id: create the producer with a \
                 transactional id to use transactions",
            ));
        };
        if self.shared.state.lock().open {
            return Err(Error::config(format!(
                "begin() on transactional producer '{id}' while a transaction is open: \
                 expected commit() or abort() first"
            )));
        }
        let native = ensure_initialized(&self.shared).await?;
        if let Err(e) = native.begin_transaction() {
            if is_producer_fenced(&e) {
                self.shared.state.lock().fenced = Some(format!("begin_transaction: {e}"));
            } else if is_fatal(&e) {
                self.shared.state.lock().needs_reinit = true;
            }
            return Err(errors::map(
                e,
                format_args!("begin_transaction for transactional id '{id}'"),
            ));
        }
        self.shared.state.lock().open = true;
        Ok(Box::new(KafkaTransaction {
            shared: self.shared.clone(),
            native,
            id,
            done: false,
            offsets: Vec::new(),
        }))
    }

    async fn settle_transactions(&self) -> Result<()> {
        if self.shared.transactional_id.is_none() {
            return Ok(());
        }
        ensure_initialized(&self.shared).await.map(|_| ())
    }

    async fn flush(&self, timeout: Duration) -> Result<()> {
        let native = self.native();
        tokio::task::spawn_blocking(move || native.flush(timeout))
            .await
            .map_err(|e| errors::join(e, "flush"))?
            .map_err(|e| run_blocking_err(e, "flush of the Kafka producer"))
    }

    async fn close(&self) -> Result<()> {
        self.flush(self.shared.kafka.timeout).await
    }
}

/// An open Kafka transaction. Dropped without commit or abort, it is aborted in the background
/// and the producer is re-initialised before its next transaction.
struct KafkaTransaction {
    shared: Arc<Shared>,
    native: Native,
    id: String,
    done: bool,
    /// Positions to commit with the transaction, per group: sent with
    /// `send_offsets_to_transaction` right before `commit_transaction`, so the group
    /// coordinator checks the member's generation at commit time (KIP-447 fencing).
    offsets: Vec<PendingOffsets>,
}

struct PendingOffsets {
    group: String,
    metadata: Arc<KafkaGroupMetadata>,
    offsets: std::collections::BTreeMap<TopicPartition, i64>,
}

/// A commit that timed out or otherwise ended unknown (`mapped`): it may have committed, or
/// commit later (a delayed EndTxn). Settles it before returning: a fresh producer's
/// init_transactions (InitProducerId, KIP-98) bumps the epoch, which fences this producer and
/// makes the coordinator finish the transaction, committed or aborted. Only then are the
/// group's committed positions final: a caller that read them earlier and redid the work after
/// them wrote it twice once the delayed commit landed.
async fn settle_unknown(shared: &Shared, mapped: Error) -> Error {
    shared.state.lock().needs_reinit = true;
    let settled = match ensure_initialized(shared).await {
        Ok(_) => "the producer was re-initialised (a new epoch fenced the old one), so the \
                  transaction is now committed or aborted: read the committed positions to know \
                  which"
            .to_string(),
        Err(e) => format!(
            "re-initialising the producer to settle it failed ({}): call \
             settle_transactions() before reading committed positions",
            e.message()
        ),
    };
    Error::new(
        ErrorKind::Timeout,
        format!("{}; the outcome is unknown; {settled}", mapped.message()),
    )
    .with_outcome_unknown()
    .with_source(mapped)
}

impl KafkaTransaction {
    async fn send_offsets(&self, pending: PendingOffsets) -> Result<()> {
        let mut tpl = TopicPartitionList::with_capacity(pending.offsets.len());
        for (tp, next) in &pending.offsets {
            tpl.add_partition_offset(&tp.topic, tp.partition, Offset::Offset(*next))
                .map_err(|e| errors::map(e, format_args!("offset {next} of {tp}")))?;
        }
        let native = self.native.clone();
        let timeout = self.shared.kafka.timeout;
        let md = pending.metadata;
        let res = bounded(
            &self.shared,
            "send_offsets_to_transaction",
            timeout,
            move || native.send_offsets_to_transaction(&tpl, &md.native, timeout),
        )
        .await?;
        res.map_err(|e| {
            self.note(&e, "send_offsets_to_transaction");
            errors::map(
                e,
                format_args!(
                    "send_offsets_to_transaction for group '{}' in the transaction of '{}'",
                    pending.group, self.id
                ),
            )
        })
    }

    fn finish(&mut self) {
        self.done = true;
        self.shared.state.lock().open = false;
    }

    /// Records what an error means for the producer's next transaction.
    fn note(&self, e: &KafkaError, what: &str) {
        let mut st = self.shared.state.lock();
        if is_producer_fenced(e) {
            st.fenced = Some(format!(
                "{what} of transactional id '{}': fenced: {e}",
                self.id
            ));
        } else if is_fatal(e) {
            st.needs_reinit = true;
        }
    }
}

#[async_trait]
impl TransactionBackend for KafkaTransaction {
    async fn send(&mut self, record: Record) -> Result<Delivery> {
        if let Some(why) = &self.shared.state.lock().fenced {
            return Err(Error::new(ErrorKind::Fenced, why.clone()));
        }
        let res = send_on(&self.native, record, self.shared.limits).await;
        if let Err(e) = &res {
            if e.kind() == ErrorKind::Fenced {
                self.shared.state.lock().fenced = Some(e.message().to_string());
            }
        }
        res
    }

    async fn send_batch(&mut self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        if let Some(why) = &self.shared.state.lock().fenced {
            return records
                .iter()
                .map(|_| Err(Error::new(ErrorKind::Fenced, why.clone())))
                .collect();
        }
        let out = send_all_on(
            &self.native,
            records,
            self.shared.limits,
            self.shared.linger,
        )
        .await;
        if let Some(e) = out
            .iter()
            .find_map(|r| r.as_ref().err().filter(|e| e.kind() == ErrorKind::Fenced))
        {
            self.shared.state.lock().fenced = Some(e.message().to_string());
        }
        out
    }

    async fn enqueue_batch(&mut self, records: Vec<Record>) -> DeliveriesFuture {
        if let Some(why) = &self.shared.state.lock().fenced {
            let failed = records
                .iter()
                .map(|_| Err(Error::new(ErrorKind::Fenced, why.clone())))
                .collect();
            return Box::pin(std::future::ready(failed));
        }
        // Enqueue now (librdkafka sends in the background, after `linger.ms` so that later
        // batches join these); await the reports later.
        let enqueued = enqueue_all(&self.native, &records, self.shared.limits).await;
        let shared = self.shared.clone();
        let native = self.native.clone();
        Box::pin(async move {
            let out = reports_of(shared.clone(), native, enqueued, records).await;
            if let Some(e) = out
                .iter()
                .find_map(|r| r.as_ref().err().filter(|e| e.kind() == ErrorKind::Fenced))
            {
                shared.state.lock().fenced = Some(e.message().to_string());
            }
            out
        })
    }

    async fn commit_offsets(
        &mut self,
        group: &GroupMetadata,
        positions: &[(TopicPartition, Position)],
    ) -> Result<()> {
        let native_md = group
            .native
            .clone()
            .and_then(|n| n.downcast::<KafkaGroupMetadata>().ok())
            .ok_or_else(|| {
                Error::config(format!(
                    "group metadata of group '{}' is not from a Kafka consumer: expected \
                     KafkaConsumer::group_metadata()",
                    group.group
                ))
            })?;
        let mut parsed = Vec::with_capacity(positions.len());
        for (tp, p) in positions {
            let o = p.as_offset().filter(|o| *o >= 0).ok_or_else(|| {
                Error::config(format!(
                    "position '{p}' of {tp} is not a Kafka offset: expected offset:N"
                ))
            })?;
            // Past markers and aborted records the consumer skipped (KAFKA-6607).
            let next = native_md.progress.next_offset(tp, o);
            parsed.push((tp.clone(), next));
        }
        let idx = match self.offsets.iter().position(|p| p.group == group.group) {
            Some(i) => {
                // The newest metadata of the group wins.
                self.offsets[i].metadata = native_md;
                i
            }
            None => {
                self.offsets.push(PendingOffsets {
                    group: group.group.clone(),
                    metadata: native_md,
                    offsets: Default::default(),
                });
                self.offsets.len() - 1
            }
        };
        self.offsets[idx].offsets.extend(parsed);
        Ok(())
    }

    async fn commit(mut self: Box<Self>) -> Result<()> {
        let native = self.native.clone();
        let timeout = self.shared.kafka.timeout;
        let mut sent = Vec::with_capacity(self.offsets.len());
        for pending in std::mem::take(&mut self.offsets) {
            let committed: Vec<(TopicPartition, i64)> = pending
                .offsets
                .iter()
                .map(|(tp, next)| (tp.clone(), *next))
                .collect();
            sent.push((pending.metadata.progress.clone(), committed));
            if let Err(e) = self.send_offsets(pending).await {
                // Fenced (KIP-447) or otherwise failed: nothing of this transaction may show.
                let producer_fenced = self.shared.state.lock().fenced.is_some();
                if !producer_fenced {
                    let n = self.native.clone();
                    let aborted = bounded(&self.shared, "abort_transaction", timeout, move || {
                        abort_blocking(&n, timeout)
                    })
                    .await;
                    if !matches!(aborted, Ok(Ok(()))) {
                        self.shared.state.lock().needs_reinit = true;
                    }
                }
                self.finish();
                return Err(e);
            }
        }
        let res = bounded(&self.shared, "commit_transaction", timeout, move || {
            commit_blocking(&native, timeout)
        })
        .await;
        self.finish();
        let e = match res {
            Ok(Ok(())) => {
                for (progress, offsets) in sent {
                    progress.committed_here(offsets);
                }
                return Ok(());
            }
            Ok(Err(e)) => e,
            // librdkafka did not return: the EndTxn may be on its way, so the outcome is
            // unknown, as for a commit that timed out.
            Err(unanswered) => return Err(settle_unknown(&self.shared, unanswered).await),
        };
        self.note(&e, "commit_transaction");
        let mapped = errors::map(
            e,
            format_args!("commit of the transaction of '{}'", self.id),
        );
        match mapped.kind() {
            ErrorKind::Aborted => {
                // Abortable: abort now, so nothing of it becomes visible.
                let native = self.native.clone();
                let aborted = bounded(&self.shared, "abort_transaction", timeout, move || {
                    abort_blocking(&native, timeout)
                })
                .await;
                if !matches!(aborted, Ok(Ok(()))) {
                    self.shared.state.lock().needs_reinit = true;
                }
                Err(mapped)
            }
            ErrorKind::Fenced => Err(mapped),
            _ => Err(settle_unknown(&self.shared, mapped).await),
        }
    }

    async fn abort(mut self: Box<Self>) -> Result<()> {
        let native = self.native.clone();
        let timeout = self.shared.kafka.timeout;
        let res = bounded(&self.shared, "abort_transaction", timeout, move || {
            abort_blocking(&native, timeout)
        })
        .await;
        self.finish();
        match res? {
            Ok(()) => Ok(()),
            Err(e) => {
                self.note(&e, "abort_transaction");
                if !is_producer_fenced(&e) {
                    self.shared.state.lock().needs_reinit = true;
                }
                Err(errors::map(
                    e,
                    format_args!("abort of the transaction of '{}'", self.id),
                ))
            }
        }
    }
}

impl Drop for KafkaTransaction {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.shared.state.lock();
        st.open = false;
        st.needs_reinit = true;
        drop(st);
        let native = self.native.clone();
        let timeout = self.shared.kafka.timeout;
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn_blocking(move || {
                let _ = abort_blocking(&native, timeout);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rdkafka::producer::{BaseProducer, BaseRecord, PurgeConfig};

    /// [`wire_size`] is librdkafka's own count: with `message.max.bytes` set to a record's wire
    /// size librdkafka takes the record, one byte lower it refuses it (both when produced, on
    /// the calling thread, before any broker is involved).
    #[test]
    fn wire_size_is_what_librdkafka_checks() {
        let records = [
            Record::new("t", vec![b'x'; 1000]),
            Record::new("t", vec![b'x'; 1000]).key(vec![b'k'; 20]),
            Record::new("t", vec![b'x'; 990])
                .header("a", b"v".to_vec())
                .header("traceparent", vec![b'0'; 55]),
            // Lengths of 64 and more take two varint bytes.
            Record::new("t", vec![b'x'; 900])
                .header("n".repeat(70), vec![b'y'; 200])
                .header("empty", Vec::new()),
        ];
        for r in &records {
            let wire = wire_size(r);
            for (limit, taken) in [(wire, true), (wire - 1, false)] {
                let p: BaseProducer = rdkafka::ClientConfig::new()
                    .set("bootstrap.servers", "127.0.0.1:1")
                    .set("message.max.bytes", limit.to_string())
                    .create()
                    .expect("producer");
                let mut br = BaseRecord::<[u8], [u8]>::to(&r.topic).payload(&r.payload[..]);
                if let Some(k) = &r.key {
                    br = br.key(&k[..]);
                }
                if let Some(h) = headers_of(r) {
                    br = br.headers(h);
                }
                let sent = p.send(br).map_err(|(e, _)| e);
                assert_eq!(
                    sent.is_ok(),
                    taken,
                    "message.max.bytes={limit}, wire size {wire}: {sent:?}"
                );
                let limits = SizeLimits {
                    record: usize::MAX,
                    wire: limit,
                    wire_is_default: false,
                };
                assert_eq!(check_size(r, limits).is_ok(), taken, "{limit}");
                p.purge(PurgeConfig::default().queue().inflight());
            }
        }
    }

    /// `message.max.bytes` is read as librdkafka reads it: here each spelling gives a
    /// producer that takes a record of 20 000 bytes with framing and refuses one of 20 001.
    #[test]
    fn message_max_bytes_is_read_as_librdkafka_reads_it() {
        for v in [
            "20000",
            " 20000",
            "+20000",
            "0x4e20",
            "0X4E20",
            "047040",
            "20000b",
            "20000 ",
            "4294987296",
        ] {
            assert_eq!(librdkafka_int(v), Some(20_000), "{v:?}");
            let p: BaseProducer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", "127.0.0.1:1")
                .set("message.max.bytes", v)
                .create()
                .expect("producer");
            for (len, taken) in [(20_000 - 36, true), (20_001 - 36, false)] {
                let payload = vec![b'x'; len];
                let sent = p.send(BaseRecord::<[u8], [u8]>::to("t").payload(&payload[..]));
                assert_eq!(sent.is_ok(), taken, "{v:?}, {len}");
            }
            p.purge(PurgeConfig::default().queue().inflight());
        }
        for v in ["", "x", "-5", "0x"] {
            assert!(librdkafka_int(v).unwrap_or(0) < 1000, "{v:?}");
        }
    }

    #[test]
    fn a_record_over_message_max_bytes_once_framed_is_named() {
        let r = Record::new("orders", vec![b'x'; 2000]);
        let e = check_size(
            &r,
            SizeLimits {
                record: 2048,
                wire: 2020,
                wire_is_default: false,
            },
        )
        .unwrap_err();
        assert_eq!(e.kind(), onceflow_core::ErrorKind::Config);
        let m = e.to_string();
        for part in [
            "2000 bytes",
            "'orders'",
            "2036 bytes",
            "message.max.bytes = 2020",
        ] {
            assert!(m.contains(part), "{part}: {m}");
        }
    }
}
