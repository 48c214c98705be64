//! The producer's enqueue path and its delivery reports: every `unsafe` of the send path is
//! here, behind a safe interface ([`enqueue_all`], [`send_on`], [`Enqueued::delivered`] and
//! [`ReportContext`], the native producer's context).
//!
//! Invariants the unsafe code relies on (each `SAFETY` comment below names the one it uses):
//! 1. **One report slot per record, one writer.** [`Reports::new`] allocates one [`Slot`] per
//!    record; a slot is handed out at most once, as the record's only [`SlotRef`], which alone
//!    writes it ([`SlotRef::fill`], from librdkafka's poll thread).
//! 2. **Counted out exactly once.** `Reports::remaining` starts at records + 1 (the enqueuing
//!    caller's share, held by a [`Hold`]). Each `SlotRef` counts its record out when dropped —
//!    after its report, or unreported (cancelled) — and the `Hold` gives back the caller's
//!    share and every index never handed out, on every way out of the caller, a cancelled
//!    future included. The [`release`] that brings `remaining` to zero wakes the waiter and
//!    gives back the strong count `Reports::new` took for the records in flight.
//! 3. **Reads after the last write.** Slots are read ([`Reports::reports`]) only after
//!    [`Reports::all_in`]: every `SlotRef` is gone, and its write happened before its
//!    `AcqRel` decrement of `remaining`.
//! 4. **An opaque crosses into librdkafka and back once.** `IntoOpaque::into_ptr` forgets the
//!    `SlotRef`; it comes back through `from_ptr` exactly once: in the delivery callback, when
//!    rust-rdkafka's produce call refuses the record, or through [`give_back`] for a message of
//!    an `rd_kafka_produce_batch` run librdkafka did not take (which then clears the pointer).
//! 5. **Borrowed bytes only during the call.** A [`Run`]'s messages point into the caller's
//!    records' payloads and keys; they are read only inside `rd_kafka_produce_batch`, which
//!    copies them (`RD_KAFKA_MSG_F_COPY`), while `enqueue_run` borrows the records. The run's
//!    topic handle is destroyed once, when the `Run` is dropped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_core::{Delivery, Error, Position, Record, Result};
use parking_lot::Mutex;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::ClientContext;

use super::{check_size, headers_of, send_error, NativeProducer, SizeLimits};

/// How long a send may wait for room in librdkafka's local queue before failing.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(30);

/// What librdkafka reported for one record: partition, offset and timestamp, or the error.
type Report = std::result::Result<(i32, i64, Option<i64>), KafkaError>;

/// A slot's report as its delivery callback wrote it (24 bytes; a failure's error is kept in
/// [`Reports::errors`]).
#[derive(Clone, Copy)]
struct Reported {
    offset: i64,
    /// Milliseconds since the epoch; meaningful with [`DELIVERED_AT`].
    timestamp: i64,
    partition: i32,
    state: u8,
}

/// No report: the record was never delivered to the callback (it reads as cancelled).
const NOT_REPORTED: u8 = 0;
/// Delivered, without a timestamp.
const DELIVERED: u8 = 1;
/// Delivered, with a timestamp.
const DELIVERED_AT: u8 = 2;
/// Failed: the error is in [`Reports::errors`] under the slot's index.
const FAILED: u8 = 3;

/// One record's report, inside its batch's [`Reports`]: 32 bytes, written at most once, by
/// the delivery callback through the record's only [`SlotRef`], and read only once every
/// report is in ([`Reports::all_in`]). (An `OnceLock<Report>` per slot made it 56 bytes: a
/// 200 000-record batch's slots alone cost ~2 700 page faults more.)
struct Slot {
    report: std::cell::UnsafeCell<Reported>,
    /// The `Reports` this slot belongs to (its address, known from `Arc::new_cyclic`).
    owner: *const Reports,
}

/// The delivery reports of records enqueued together.
///
/// No allocation and no shared counter update per record on the enqueuing side: each record's
/// delivery opaque is a [`SlotRef`], a pointer to its slot in this one allocation, and
/// `remaining` is set for the whole batch up front. (With a `Box` per record, freed on the
/// poll thread, and a reference count and counter updated by both threads, the report
/// bookkeeping cost more than librdkafka's own produce call.)
struct Reports {
    slots: Box<[Slot]>,
    /// The errors of failed records, by slot index, in the order they were reported.
    errors: Mutex<Vec<(usize, KafkaError)>>,
    /// Records not yet reported (slots whose [`SlotRef`] is alive or not yet handed out),
    /// plus one for the enqueuing caller until it has handed every record over.
    remaining: AtomicUsize,
    done: tokio::sync::Notify,
}

// SAFETY: `owner` is only dereferenced by `release`, under the liveness rules given there; a
// slot's `report` is written only through its one `SlotRef` and read only after `remaining`
// reached zero (see `Slot`); every other field is Send + Sync.
#[allow(unsafe_code)]
unsafe impl Send for Reports {}
#[allow(unsafe_code)]
unsafe impl Sync for Reports {}

impl Reports {
    /// Reports for `len` records. The records in flight keep the allocation alive together:
    /// one strong count taken here, given back by the [`release`] that brings `remaining` to
    /// zero.
    fn new(len: usize) -> Arc<Reports> {
        let reports = Arc::new_cyclic(|me| Reports {
            slots: (0..len)
                .map(|_| Slot {
                    report: std::cell::UnsafeCell::new(Reported {
                        offset: 0,
                        timestamp: 0,
                        partition: 0,
                        state: NOT_REPORTED,
                    }),
                    owner: me.as_ptr(),
                })
                .collect(),
            errors: Mutex::new(Vec::new()),
            remaining: AtomicUsize::new(len + 1),
            done: tokio::sync::Notify::new(),
        });
        // The records' shared strong count, given back by `release` through this pointer.
        let _ = Arc::into_raw(Arc::clone(&reports));
        reports
    }

    /// The opaque for record `index`'s delivery report. Each index is handed out at most once.
    fn slot(self: &Arc<Self>, index: usize) -> SlotRef {
        SlotRef(std::ptr::NonNull::from(&self.slots[index]))
    }

    /// Every slot's report, in index order, once [`Reports::all_in`] returned (a slot never
    /// filled reads as cancelled).
    #[allow(unsafe_code)]
    fn reports(&self) -> impl Iterator<Item = Report> + '_ {
        let mut errors = std::mem::take(&mut *self.errors.lock());
        errors.sort_unstable_by_key(|(i, _)| *i);
        let mut errors = errors.into_iter().peekable();
        self.slots.iter().enumerate().map(move |(i, slot)| {
            // SAFETY: every report is in (`all_in`): no `SlotRef` is left to write a slot, and
            // the writes happened before `remaining` reached zero (see `release`).
            let r = unsafe { *slot.report.get() };
            match r.state {
                DELIVERED => Ok((r.partition, r.offset, None)),
                DELIVERED_AT => Ok((r.partition, r.offset, Some(r.timestamp))),
                FAILED => match errors.next_if(|(e, _)| *e == i) {
                    Some((_, e)) => Err(e),
                    None => Err(KafkaError::Canceled),
                },
                _ => Err(KafkaError::Canceled),
            }
        })
    }

    /// Waits until every slot has been filled or released.
    async fn all_in(&self) {
        if self.remaining.load(Ordering::Acquire) != 0 {
            self.done.notified().await;
        }
    }
}

/// Counts `n` (≥ 1) records, or the enqueuing caller's share, out of `reports`; the last one
/// wakes the waiter and gives back the in-flight records' strong count.
///
/// # Safety
/// `reports` points to a live `Reports` (from `Arc`) in whose `remaining` this caller still
/// holds `n` counts; the caller must not touch it afterwards unless it holds its own `Arc`.
#[allow(unsafe_code)]
unsafe fn release(reports: *const Reports, n: usize) {
    debug_assert!(n > 0);
    // SAFETY: live, per the contract.
    let r = unsafe { &*reports };
    if r.remaining.fetch_sub(n, Ordering::AcqRel) == n {
        r.done.notify_one();
        // SAFETY: the strong count `Reports::new` took for the records in flight; `remaining`
        // reaches zero exactly once, and `r` is not used after this.
        unsafe { Arc::decrement_strong_count(reports) };
    }
}

/// One record's delivery opaque: a pointer to its [`Slot`]. The callback fills the slot; a
/// `SlotRef` dropped without a report (the producer went away, or the record was refused and
/// handed back) reads as cancelled, as a `FutureProducer`'s dropped oneshot sender does.
/// Dropping it counts the record out of its `Reports`.
pub(super) struct SlotRef(std::ptr::NonNull<Slot>);

// SAFETY: a `SlotRef` is the only handle to its slot, which its `Reports` keeps alive until
// the `SlotRef` is dropped (see `Reports::new`); only the `SlotRef` writes the slot.
#[allow(unsafe_code)]
unsafe impl Send for SlotRef {}
#[allow(unsafe_code)]
unsafe impl Sync for SlotRef {}

#[allow(unsafe_code)]
impl SlotRef {
    fn slot(&self) -> &Slot {
        // SAFETY: the slot lives as long as this `SlotRef` (see the `Send` impl).
        unsafe { self.0.as_ref() }
    }

    /// Writes the record's report into its slot (an error into its `Reports`' errors).
    fn fill(&self, report: Report) {
        let slot = self.slot();
        let reported = match report {
            Ok((partition, offset, timestamp)) => Reported {
                offset,
                timestamp: timestamp.unwrap_or(0),
                partition,
                state: if timestamp.is_some() {
                    DELIVERED_AT
                } else {
                    DELIVERED
                },
            },
            Err(e) => {
                // SAFETY: the owner outlives its slots' `SlotRef`s (see `Reports::new`).
                let owner = unsafe { &*slot.owner };
                let index = (self.0.as_ptr() as usize - owner.slots.as_ptr() as usize)
                    / std::mem::size_of::<Slot>();
                owner.errors.lock().push((index, e));
                Reported {
                    offset: 0,
                    timestamp: 0,
                    partition: 0,
                    state: FAILED,
                }
            }
        };
        // SAFETY: this `SlotRef` is the slot's only writer, and nothing reads the slot before
        // the `SlotRef` is dropped (it counts the record out of `remaining` then).
        unsafe { *slot.report.get() = reported };
    }
}

#[allow(unsafe_code)]
impl Drop for SlotRef {
    fn drop(&mut self) {
        let slot = self.slot();
        let owner = slot.owner;
        // SAFETY: this record was counted in `remaining` by `Reports::new` and is counted out
        // once, here; the slot is not touched afterwards.
        unsafe { release(owner, 1) };
    }
}

/// `into_ptr` hands the `SlotRef` over as its slot pointer (not dropped), and `from_ptr` takes
/// it back exactly once (librdkafka's delivery callback, or rust-rdkafka when the produce call
/// refused the record).
#[allow(unsafe_code)]
impl rdkafka::util::IntoOpaque for SlotRef {
    fn into_ptr(self) -> *mut std::ffi::c_void {
        let ptr = self.0.as_ptr().cast();
        std::mem::forget(self);
        ptr
    }

    unsafe fn from_ptr(ptr: *mut std::ffi::c_void) -> Self {
        // SAFETY: `ptr` came from `into_ptr`, so it is a non-null slot pointer.
        SlotRef(unsafe { std::ptr::NonNull::new_unchecked(ptr.cast()) })
    }
}

/// librdkafka's client callbacks as `DefaultClientContext` has them, and delivery reports into
/// [`Reports`].
pub(super) struct ReportContext;

impl ClientContext for ReportContext {}

impl ProducerContext for ReportContext {
    type DeliveryOpaque = SlotRef;

    fn delivery(&self, result: &DeliveryResult<'_>, slot: SlotRef) {
        slot.fill(match result {
            Ok(m) => Ok((m.partition(), m.offset(), m.timestamp().to_millis())),
            Err((e, _)) => Err(e.clone()),
        });
    }
}

fn base_record(record: &Record, slot: SlotRef) -> BaseRecord<'_, [u8], [u8], SlotRef> {
    let mut br = BaseRecord::with_opaque_to(&record.topic, slot).payload(&record.payload[..]);
    if let Some(k) = &record.key {
        br = br.key(&k[..]);
    }
    if let Some(p) = record.partition {
        br = br.partition(p);
    }
    if let Some(ts) = record.timestamp {
        br = br.timestamp(ts);
    }
    if let Some(h) = headers_of(record) {
        br = br.headers(h);
    }
    br
}

/// Hands `record` to librdkafka's queue without waiting for its delivery; its report goes to
/// `slot`. When the local queue is full (`queue.buffering.max.messages` / `.kbytes`), waits for
/// room — the producer's own poll thread drains it — at most [`QUEUE_TIMEOUT`]; the record is
/// retried before anything after it is enqueued, so order is kept.
async fn enqueue(native: &NativeProducer, record: &Record, slot: SlotRef) -> Result<()> {
    let mut deadline = None;
    let mut br = base_record(record, slot);
    loop {
        match native.send(br) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                if *deadline.get_or_insert_with(|| tokio::time::Instant::now() + QUEUE_TIMEOUT)
                    > tokio::time::Instant::now() =>
            {
                br = back;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err((e, _)) => return Err(send_error(e, &record.topic)),
        }
    }
}

/// The enqueuing caller's share of `remaining`: its own count and those of the records it has
/// not handed out (yet, or ever: too large). Given back when dropped, on every way out of the
/// caller, a cancelled one included (a send dropped while it waits for room in a full local
/// queue): otherwise `remaining` never reaches zero and the `Reports` is never freed.
struct Hold<'a> {
    reports: &'a Arc<Reports>,
    count: usize,
}

impl<'a> Hold<'a> {
    fn new(reports: &'a Arc<Reports>) -> Self {
        Hold {
            count: reports.slots.len() + 1,
            reports,
        }
    }

    /// Record `index`'s opaque: its count passes from this hold to the `SlotRef`.
    fn hand_out(&mut self, index: usize) -> SlotRef {
        self.count -= 1;
        self.reports.slot(index)
    }
}

#[allow(unsafe_code)]
impl Drop for Hold<'_> {
    fn drop(&mut self) {
        // SAFETY: `reports` is alive (the caller's `Arc`), and the caller's own count keeps
        // `count` ≥ 1; these counts are given back once, here.
        unsafe { release(Arc::as_ptr(self.reports), self.count) };
    }
}

/// Records enqueued together: their reports, and the records that never reached librdkafka's
/// queue (too large, or refused) with their errors, by index in ascending order.
pub(super) struct Enqueued {
    reports: Arc<Reports>,
    failed: Vec<(usize, Error)>,
}

/// Enqueues every record, in order (librdkafka batches them per partition and the idempotent
/// producer keeps their order).
///
/// Consecutive records for one topic that leave the partition, the timestamp and the headers
/// to librdkafka go in runs of up to [`PRODUCE_BATCH`] through `rd_kafka_produce_batch`
/// ([`enqueue_run`]); any other record through `rd_kafka_producev`, one by one ([`enqueue`]).
pub(super) async fn enqueue_all(
    native: &NativeProducer,
    records: &[Record],
    limits: SizeLimits,
) -> Enqueued {
    let reports = Reports::new(records.len());
    let mut failed = Vec::new();
    let mut hold = Hold::new(&reports);
    let mut i = 0;
    while i < records.len() {
        let r = &records[i];
        if batchable(r) {
            let end = records[i..]
                .iter()
                .take(PRODUCE_BATCH)
                .position(|n| !batchable(n) || n.topic != r.topic)
                .map_or((i + PRODUCE_BATCH).min(records.len()), |k| i + k);
            if enqueue_run(native, records, i..end, limits, &mut hold, &mut failed).await {
                i = end;
                continue;
            }
        }
        // A record never handed out stays counted in `hold` (a refused `SlotRef` counts
        // itself out).
        let res = match check_size(r, limits) {
            Ok(()) => enqueue(native, r, hold.hand_out(i)).await,
            Err(e) => Err(e),
        };
        if let Err(e) = res {
            failed.push((i, e));
        }
        i += 1;
    }
    drop(hold);
    Enqueued { reports, failed }
}

/// librdkafka's `RD_KAFKA_PARTITION_UA`: the partitioner places the record.
const PARTITION_UA: i32 = -1;

/// Most records handed to one `rd_kafka_produce_batch` call (it holds the topic's read lock
/// for the call).
const PRODUCE_BATCH: usize = 1024;

/// Whether `record` can go through `rd_kafka_produce_batch`, which takes neither headers nor a
/// timestamp (every record gets the call's time, as `rd_kafka_producev` gives a record without
/// one its own), and whose fixed-partition path leaks a record refused for an unknown
/// partition (librdkafka 2.12 `rdkafka_msg.c`): only records the partitioner places.
fn batchable(record: &Record) -> bool {
    record.partition.is_none() && record.timestamp.is_none() && record.headers.is_empty()
}

/// Takes back the [`SlotRef`] of a message of a run that librdkafka did not take (dropping
/// it counts the record out as cancelled) and clears the message's opaque, so it is given back
/// once.
#[allow(unsafe_code)]
fn give_back(m: &mut rdkafka::bindings::rd_kafka_message_t) {
    if m._private.is_null() {
        return;
    }
    // SAFETY: a non-null opaque of a message librdkafka did not take is still the `SlotRef`
    // handed over by `into_ptr`; it is cleared right after, so it is taken back once.
    drop(unsafe { <SlotRef as rdkafka::util::IntoOpaque>::from_ptr(m._private) });
    m._private = std::ptr::null_mut();
}

/// Records of one `rd_kafka_produce_batch` run not yet accepted by librdkafka, from `from` on:
/// their opaques (`SlotRef`s) are given back when this is dropped, and with them the topic
/// handle, on every way out of [`enqueue_run`], a cancelled one included.
struct Run {
    topic: *mut rdkafka::bindings::rd_kafka_topic_t,
    messages: Vec<rdkafka::bindings::rd_kafka_message_t>,
    /// The index in the caller's records of each message.
    index: Vec<usize>,
    from: usize,
}

// SAFETY: the topic handle and the opaques are owned by this value alone (librdkafka's topic
// handles may be used and destroyed from any thread); the payload and key pointers are only
// read during `rd_kafka_produce_batch` calls, made while the records they point into are
// borrowed by `enqueue_run`.
#[allow(unsafe_code)]
unsafe impl Send for Run {}

#[allow(unsafe_code)]
impl Drop for Run {
    fn drop(&mut self) {
        for m in &mut self.messages[self.from..] {
            give_back(m);
        }
        // SAFETY: the handle came from `rd_kafka_topic_new` and is destroyed once.
        unsafe { rdkafka::bindings::rd_kafka_topic_destroy(self.topic) };
    }
}

/// Enqueues `records[range]` (one topic, each [`batchable`]) through `rd_kafka_produce_batch`:
/// one topic lookup, one clock reading and one read lock per call instead of per record, and
/// no topic name copy per record. A record too large, or refused by librdkafka, fails at its
/// index; when the local queue is full, waits for room as [`enqueue`] does and goes on with
/// the first record not taken, so order is kept. `false` (nothing enqueued, nothing handed
/// out) when librdkafka has no handle for the topic name (a NUL in it): [`enqueue`] then names
/// the error per record.
#[allow(unsafe_code)]
async fn enqueue_run(
    native: &NativeProducer,
    records: &[Record],
    range: std::ops::Range<usize>,
    limits: SizeLimits,
    hold: &mut Hold<'_>,
    failed: &mut Vec<(usize, Error)>,
) -> bool {
    use rdkafka::bindings as rd;
    let topic_name = &records[range.start].topic;
    let Ok(c_topic) = std::ffi::CString::new(topic_name.as_str()) else {
        return false;
    };
    // SAFETY: the rd_kafka_t is owned by `native`, alive for the call; `c_topic` is a valid C
    // string; a NULL configuration takes the producer's default topic configuration, as
    // `rd_kafka_producev` does.
    let topic = unsafe {
        rd::rd_kafka_topic_new(
            native.client().native_ptr(),
            c_topic.as_ptr(),
            std::ptr::null_mut(),
        )
    };
    if topic.is_null() {
        return false;
    }
    let mut run = Run {
        topic,
        messages: Vec::with_capacity(range.len()),
        index: Vec::with_capacity(range.len()),
        from: 0,
    };
    let mut refused = Vec::new();
    for i in range {
        let r = &records[i];
        if let Err(e) = check_size(r, limits) {
            refused.push((i, e));
            continue;
        }
        let (key, key_len) = r.key.as_ref().map_or((std::ptr::null_mut(), 0), |k| {
            (k.as_ptr() as *mut _, k.len())
        });
        run.messages.push(rd::rd_kafka_message_t {
            err: rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR,
            rkt: std::ptr::null_mut(),
            partition: -1,
            payload: r.payload.as_ptr() as *mut _,
            len: r.payload.len(),
            key,
            key_len,
            offset: 0,
            _private: rdkafka::util::IntoOpaque::into_ptr(hold.hand_out(i)),
        });
        run.index.push(i);
    }
    let mut deadline = None;
    while run.from < run.messages.len() {
        let pending = &mut run.messages[run.from..];
        // SAFETY: `topic` is a live handle; `pending` is a valid array of its length (which
        // fits an int: at most PRODUCE_BATCH); librdkafka copies every payload and key
        // (RD_KAFKA_MSG_F_COPY) before returning, and sets each message's `err`.
        unsafe {
            rd::rd_kafka_produce_batch(
                run.topic,
                PARTITION_UA,
                rd::RD_KAFKA_MSG_F_COPY,
                pending.as_mut_ptr(),
                pending.len() as std::ffi::c_int,
            )
        };
        let mut queue_full = None;
        for (k, m) in pending.iter_mut().enumerate() {
            match m.err {
                rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR => {}
                rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__QUEUE_FULL => {
                    // This one and every one after it were not taken.
                    queue_full = Some(k);
                    break;
                }
                err => {
                    give_back(m);
                    let e = KafkaError::MessageProduction(err.into());
                    refused.push((run.index[run.from + k], send_error(e, topic_name)));
                }
            }
        }
        // Refused messages are skipped from here on (their opaques are given back).
        let Some(k) = queue_full else {
            run.from = run.messages.len();
            break;
        };
        run.from += k;
        if k > 0 {
            // Room was found for some: the wait for room starts again.
            deadline = None;
        }
        let now = tokio::time::Instant::now();
        let timed_out = *deadline.get_or_insert(now + QUEUE_TIMEOUT) <= now;
        if timed_out {
            // The first record not taken found no room for QUEUE_TIMEOUT (it may never fit:
            // larger than `queue.buffering.max.kbytes`): it fails alone, as with `enqueue`, and
            // the records after it get their own wait.
            give_back(&mut run.messages[run.from]);
            let e = KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull);
            refused.push((run.index[run.from], send_error(e, topic_name)));
            run.from += 1;
            deadline = None;
        }
        for m in &mut run.messages[run.from..] {
            m.err = rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR;
        }
        if !timed_out {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    drop(run);
    refused.sort_unstable_by_key(|(i, _)| *i);
    failed.append(&mut refused);
    true
}

// `Enqueued::delivered` collects its results in place of the records only while a result is
// no larger than a record, with the same alignment.
const _: () = assert!(
    std::mem::size_of::<Result<Delivery>>() <= std::mem::size_of::<Record>()
        && std::mem::align_of::<Result<Delivery>>() == std::mem::align_of::<Record>()
);

impl Enqueued {
    pub(super) fn any_enqueued(&self, len: usize) -> bool {
        self.failed.len() < len
    }

    /// Waits for every report: one result per record, in input order. A delivery takes its
    /// topic name from its record.
    ///
    /// The results are written over the records' own allocation (`into_iter().map().collect()`
    /// collects in place: a result is smaller than a record): a fresh vector of a 200 000-record
    /// batch cost ~4 000 page faults, on the caller's path after the last report.
    pub(super) async fn delivered(self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        self.reports.all_in().await;
        let mut failed = self.failed.into_iter().peekable();
        let mut reports = self.reports.reports();
        records
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let report = reports.next().unwrap_or(Err(KafkaError::Canceled));
                match failed.next_if(|(f, _)| *f == i) {
                    Some((_, e)) => Err(e),
                    None => delivery_of(r.topic, report),
                }
            })
            .collect()
    }
}

/// A record's result from its report; the delivery takes the record's topic name. Its
/// `attempts` is 1: librdkafka resends inside and does not say how often (see
/// [`Delivery::attempts`]).
fn delivery_of(topic: String, report: Report) -> Result<Delivery> {
    match report {
        Ok((partition, offset, timestamp)) => {
            Ok(Delivery::new(topic, partition, Position::Offset(offset)).timestamp(timestamp))
        }
        Err(e) => Err(send_error(e, &topic)),
    }
}

/// Sends one record and waits for its report: a single `send`'s path, the batch path's steps
/// for one record without its record `Vec`, failure list and result `Vec` (a single send is
/// the Python and Node bindings' per-record awaitable, where these allocations showed).
pub(super) async fn send_on(
    native: &NativeProducer,
    record: Record,
    limits: SizeLimits,
) -> Result<Delivery> {
    check_size(&record, limits)?;
    let reports = Reports::new(1);
    let mut hold = Hold::new(&reports);
    let enqueued = enqueue(native, &record, hold.hand_out(0)).await;
    drop(hold);
    enqueued?;
    reports.all_in().await;
    let report = reports
        .reports()
        .next()
        .unwrap_or(Err(KafkaError::Canceled));
    delivery_of(record.topic, report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_report_reads_back_at_its_index() {
        assert_eq!(std::mem::size_of::<Slot>(), 32);
        let reports = Reports::new(5);
        let mut hold = Hold::new(&reports);
        let slots: Vec<SlotRef> = (0..4).map(|i| hold.hand_out(i)).collect();
        // Index 4 is never handed out (a record refused before librdkafka saw it).
        drop(hold);
        let mut slots = slots.into_iter();
        let (s0, s1, s2, s3) = (
            slots.next().unwrap(),
            slots.next().unwrap(),
            slots.next().unwrap(),
            slots.next().unwrap(),
        );
        // Reported out of order, from another thread, as librdkafka's poll thread does.
        std::thread::spawn(move || {
            s3.fill(Err(KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageTimedOut,
            )));
            s1.fill(Err(KafkaError::MessageProduction(
                RDKafkaErrorCode::PurgeQueue,
            )));
            s0.fill(Ok((2, 41, Some(1_700_000_000_000))));
            drop(s2);
        })
        .join()
        .unwrap();
        reports.all_in().await;
        let got: Vec<Report> = reports.reports().collect();
        assert_eq!(
            got[0].as_ref().ok(),
            Some(&(2, 41, Some(1_700_000_000_000)))
        );
        assert_eq!(
            got[1].as_ref().err(),
            Some(&KafkaError::MessageProduction(RDKafkaErrorCode::PurgeQueue))
        );
        assert_eq!(got[2].as_ref().err(), Some(&KafkaError::Canceled));
        assert_eq!(
            got[3].as_ref().err(),
            Some(&KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageTimedOut
            ))
        );
        assert_eq!(got[4].as_ref().err(), Some(&KafkaError::Canceled));
        assert_eq!(got.len(), 5);
    }
}
