//! Engine metrics: counted in-process (readable in code through [`Metrics::snapshot`]) and
//! exported through the globally installed OpenTelemetry meter provider, with the instrument
//! names below (`onceflow.*`). Without a meter provider the OpenTelemetry side is a no-op.
//!
//! The bounded memory dedup store counts on its own, per store rather than per engine:
//! `onceflow.dedup.evicted_in_window`, keys it evicted while still inside their dedup window
//! (read in code with [`crate::dedup::MemoryStore::evicted_in_window`]).
//!
//! Producers count their resends, outside any engine: [`SEND_RETRIES`], read in code with
//! [`send_retries`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use opentelemetry::metrics::{Counter, Gauge};
use opentelemetry::{global, KeyValue};

use crate::backend::PartitionLag;

/// Name of the OpenTelemetry counter of malformed `traceparent` headers ignored
/// ([`MetricsSnapshot::malformed_traceparents`]). An engine's points carry
/// `messaging.system` and `messaging.consumer.group.name`; those found outside an engine
/// (a record sent with one, [`crate::trace::extract`] called directly) carry none.
pub const MALFORMED_TRACEPARENTS: &str = "onceflow.malformed_traceparents";

pub(crate) const MALFORMED_TRACEPARENTS_DESCRIPTION: &str =
    "Malformed W3C traceparent headers ignored (the message was handled outside its trace)";

/// Name of the OpenTelemetry counter of send retries: one per record sent again after an
/// attempt that failed retriably or went unanswered, so a delivery of
/// [`attempts`](crate::Delivery::attempts) `n` counted `n - 1` (and the resends of a send
/// that failed in the end count too). Its points carry `messaging.system`. Counted where
/// onceflow resends, JetStream and Kinesis; Kafka's and Pulsar's client libraries resend
/// inside and do not say so per record, so nothing is counted there (see
/// [`crate::Delivery::attempts`]). Read in code with [`send_retries`].
pub const SEND_RETRIES: &str = "onceflow.send_retries";

/// The process totals of [`SEND_RETRIES`], one per platform that counted any.
static SEND_RETRY_TOTALS: Mutex<Vec<(&'static str, Arc<AtomicU64>)>> = Mutex::new(Vec::new());

/// Send retries on platform `system` (`jetstream`, `kinesis`, ...) in this process so far, all
/// its producers together: the in-code reading of the OpenTelemetry counter [`SEND_RETRIES`].
pub fn send_retries(system: &str) -> u64 {
    let totals = SEND_RETRY_TOTALS
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    totals
        .iter()
        .find(|(s, _)| *s == system)
        .map_or(0, |(_, n)| n.load(Ordering::Relaxed))
}

/// Where a producer counts its resends ([`SEND_RETRIES`]): made by the adapter with the
/// producer, from the meter provider installed then (as an engine's [`Metrics`]), and bumped
/// where the adapter sends a record again. Cheap to clone.
#[derive(Clone)]
pub struct SendRetries {
    total: Arc<AtomicU64>,
    otel: Counter<u64>,
    system: KeyValue,
}

impl std::fmt::Debug for SendRetries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendRetries")
            .field("system", &self.system.value.as_str())
            .field("process_total", &self.total.load(Ordering::Relaxed))
            .finish()
    }
}

impl SendRetries {
    /// The counter of a producer on `system` (OpenTelemetry attribute `messaging.system`).
    pub fn new(system: &'static str) -> Self {
        let total = {
            let mut totals = SEND_RETRY_TOTALS
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match totals.iter().find(|(s, _)| *s == system) {
                Some((_, n)) => n.clone(),
                None => {
                    let n = Arc::new(AtomicU64::new(0));
                    totals.push((system, n.clone()));
                    n
                }
            }
        };
        let otel = global::meter(crate::trace::SCOPE)
            .u64_counter(SEND_RETRIES)
            .with_description("Records sent again after an attempt that failed or went unanswered")
            .with_unit("{retry}")
            .build();
        SendRetries {
            total,
            otel,
            system: KeyValue::new("messaging.system", system),
        }
    }

    /// Counts `n` resends.
    pub fn add(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.total.fetch_add(n, Ordering::Relaxed);
        self.otel.add(n, std::slice::from_ref(&self.system));
    }
}

/// A point-in-time copy of the engine's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Messages received from the platform (redeliveries included).
    pub consumed: u64,
    /// Messages whose handler (or transform) ran to success.
    pub processed: u64,
    /// Messages skipped because their idempotency key was already completed.
    pub duplicates_skipped: u64,
    /// Handler (or transform) invocations that returned an error.
    pub handler_errors: u64,
    /// Handler retries (invocations after the first for one delivery).
    pub retries: u64,
    /// Messages sent to the dead-letter topic.
    pub dead_lettered: u64,
    /// Messages handed back to the platform for redelivery (nack / rewind).
    pub redelivery_requests: u64,
    /// Transactions committed.
    pub transactions_committed: u64,
    /// Transactions aborted.
    pub transactions_aborted: u64,
    /// Assignment changes seen (assigned, revoked or lost events).
    pub rebalances: u64,
    /// Completions refused or work dropped because this worker was fenced.
    pub fenced: u64,
    /// Position commits sent to the platform.
    pub commits: u64,
    /// Records produced by a pipeline.
    pub produced: u64,
    /// Messages whose `traceparent` header was malformed (W3C Trace Context §3.2: not
    /// `version-traceid-parentid-flags` in lowercase hex, or an all-zero id) and was ignored:
    /// the message was processed outside the trace its producer meant (a new trace, or none).
    pub malformed_traceparents: u64,
    /// Messages whose handler (or transform) ran without an idempotency key while a dedup
    /// store was set (the key strategy found none): at-least-once, no dedup record written.
    /// Also the OpenTelemetry counter `onceflow.keyless`.
    pub keyless: u64,
}

impl MetricsSnapshot {
    /// Every counter by field name, in field order: what the bindings report (Python's
    /// `metrics()` dict).
    pub fn fields(&self) -> [(&'static str, u64); 15] {
        // Destructured without `..`: a counter added to the struct must be added here.
        let MetricsSnapshot {
            consumed,
            processed,
            duplicates_skipped,
            handler_errors,
            retries,
            dead_lettered,
            redelivery_requests,
            transactions_committed,
            transactions_aborted,
            rebalances,
            fenced,
            commits,
            produced,
            malformed_traceparents,
            keyless,
        } = *self;
        [
            ("consumed", consumed),
            ("processed", processed),
            ("duplicates_skipped", duplicates_skipped),
            ("handler_errors", handler_errors),
            ("retries", retries),
            ("dead_lettered", dead_lettered),
            ("redelivery_requests", redelivery_requests),
            ("transactions_committed", transactions_committed),
            ("transactions_aborted", transactions_aborted),
            ("rebalances", rebalances),
            ("fenced", fenced),
            ("commits", commits),
            ("produced", produced),
            ("malformed_traceparents", malformed_traceparents),
            ("keyless", keyless),
        ]
    }
}

#[derive(Default)]
struct Counts {
    consumed: AtomicU64,
    processed: AtomicU64,
    duplicates_skipped: AtomicU64,
    handler_errors: AtomicU64,
    retries: AtomicU64,
    dead_lettered: AtomicU64,
    redelivery_requests: AtomicU64,
    transactions_committed: AtomicU64,
    transactions_aborted: AtomicU64,
    rebalances: AtomicU64,
    fenced: AtomicU64,
    commits: AtomicU64,
    produced: AtomicU64,
    malformed_traceparents: AtomicU64,
    keyless: AtomicU64,
}

struct Instruments {
    consumed: Counter<u64>,
    processed: Counter<u64>,
    duplicates: Counter<u64>,
    handler_errors: Counter<u64>,
    retries: Counter<u64>,
    dead_lettered: Counter<u64>,
    transactions: Counter<u64>,
    rebalances: Counter<u64>,
    fenced: Counter<u64>,
    malformed_traceparents: Counter<u64>,
    keyless: Counter<u64>,
    lag: Gauge<u64>,
}

/// Which counter to bump.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// [`MetricsSnapshot::consumed`]
    Consumed,
    /// [`MetricsSnapshot::processed`]
    Processed,
    /// [`MetricsSnapshot::duplicates_skipped`]
    DuplicateSkipped,
    /// [`MetricsSnapshot::handler_errors`]
    HandlerError,
    /// [`MetricsSnapshot::retries`]
    Retry,
    /// [`MetricsSnapshot::dead_lettered`]
    DeadLettered,
    /// [`MetricsSnapshot::redelivery_requests`]
    RedeliveryRequested,
    /// [`MetricsSnapshot::transactions_committed`]
    TransactionCommitted,
    /// [`MetricsSnapshot::transactions_aborted`]
    TransactionAborted,
    /// [`MetricsSnapshot::rebalances`]
    Rebalance,
    /// [`MetricsSnapshot::fenced`]
    Fenced,
    /// [`MetricsSnapshot::commits`]
    Commit,
    /// [`MetricsSnapshot::produced`]
    Produced,
    /// [`MetricsSnapshot::malformed_traceparents`]
    MalformedTraceparent,
    /// [`MetricsSnapshot::keyless`]
    Keyless,
}

/// Counters of one engine instance (an idempotent consumer or a pipeline). Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    counts: Arc<Counts>,
    otel: Arc<Instruments>,
    attrs: Arc<[KeyValue]>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("snapshot", &self.snapshot())
            .finish()
    }
}

impl Metrics {
    /// Metrics for a consumer of `group` on `system` (OpenTelemetry attributes
    /// `messaging.system` and `messaging.consumer.group.name`).
    pub fn new(system: &'static str, group: &str) -> Self {
        let meter = global::meter(crate::trace::SCOPE);
        let otel = Instruments {
            consumed: meter
                .u64_counter("onceflow.consumed")
                .with_description("Messages received, redeliveries included")
                .with_unit("{message}")
                .build(),
            processed: meter
                .u64_counter("onceflow.processed")
                .with_description("Messages handled successfully")
                .with_unit("{message}")
                .build(),
            duplicates: meter
                .u64_counter("onceflow.duplicates_skipped")
                .with_description("Messages skipped as duplicates of a completed idempotency key")
                .with_unit("{message}")
                .build(),
            handler_errors: meter
                .u64_counter("onceflow.handler_errors")
                .with_unit("{error}")
                .build(),
            retries: meter
                .u64_counter("onceflow.retries")
                .with_unit("{retry}")
                .build(),
            dead_lettered: meter
                .u64_counter("onceflow.dead_lettered")
                .with_unit("{message}")
                .build(),
            transactions: meter
                .u64_counter("onceflow.transactions")
                .with_description("Transactions by outcome (attribute onceflow.outcome)")
                .with_unit("{transaction}")
                .build(),
            rebalances: meter
                .u64_counter("onceflow.rebalances")
                .with_unit("{event}")
                .build(),
            fenced: meter
                .u64_counter("onceflow.fenced")
                .with_unit("{event}")
                .build(),
            malformed_traceparents: meter
                .u64_counter(MALFORMED_TRACEPARENTS)
                .with_description(MALFORMED_TRACEPARENTS_DESCRIPTION)
                .with_unit("{message}")
                .build(),
            keyless: meter
                .u64_counter("onceflow.keyless")
                .with_description(
                    "Messages handled without an idempotency key although a dedup store was set",
                )
                .with_unit("{message}")
                .build(),
            lag: meter
                .u64_gauge("onceflow.lag")
                .with_description(
                    "Messages between the committed position and the high watermark, per partition",
                )
                .with_unit("{message}")
                .build(),
        };
        Metrics {
            counts: Arc::default(),
            otel: Arc::new(otel),
            attrs: Arc::from(vec![
                KeyValue::new("messaging.system", system),
                KeyValue::new("messaging.consumer.group.name", group.to_string()),
            ]),
        }
    }

    /// Adds `n` to a counter.
    pub fn add(&self, metric: Metric, n: u64) {
        if n == 0 {
            return;
        }
        let c = &self.counts;
        let o = &self.otel;
        let a = &self.attrs;
        match metric {
            Metric::Consumed => {
                c.consumed.fetch_add(n, Ordering::Relaxed);
                o.consumed.add(n, a);
            }
            Metric::Processed => {
                c.processed.fetch_add(n, Ordering::Relaxed);
                o.processed.add(n, a);
            }
            Metric::DuplicateSkipped => {
                c.duplicates_skipped.fetch_add(n, Ordering::Relaxed);
                o.duplicates.add(n, a);
            }
            Metric::HandlerError => {
                c.handler_errors.fetch_add(n, Ordering::Relaxed);
                o.handler_errors.add(n, a);
            }
            Metric::Retry => {
                c.retries.fetch_add(n, Ordering::Relaxed);
                o.retries.add(n, a);
            }
            Metric::DeadLettered => {
                c.dead_lettered.fetch_add(n, Ordering::Relaxed);
                o.dead_lettered.add(n, a);
            }
            Metric::RedeliveryRequested => {
                c.redelivery_requests.fetch_add(n, Ordering::Relaxed);
            }
            Metric::TransactionCommitted => {
                c.transactions_committed.fetch_add(n, Ordering::Relaxed);
                o.transactions.add(n, &self.with_outcome("committed"));
            }
            Metric::TransactionAborted => {
                c.transactions_aborted.fetch_add(n, Ordering::Relaxed);
                o.transactions.add(n, &self.with_outcome("aborted"));
            }
            Metric::Rebalance => {
                c.rebalances.fetch_add(n, Ordering::Relaxed);
                o.rebalances.add(n, a);
            }
            Metric::Fenced => {
                c.fenced.fetch_add(n, Ordering::Relaxed);
                o.fenced.add(n, a);
            }
            Metric::Commit => {
                c.commits.fetch_add(n, Ordering::Relaxed);
            }
            Metric::Produced => {
                c.produced.fetch_add(n, Ordering::Relaxed);
            }
            Metric::MalformedTraceparent => {
                c.malformed_traceparents.fetch_add(n, Ordering::Relaxed);
                o.malformed_traceparents.add(n, a);
            }
            Metric::Keyless => {
                c.keyless.fetch_add(n, Ordering::Relaxed);
                o.keyless.add(n, a);
            }
        }
    }

    fn with_outcome(&self, outcome: &'static str) -> Vec<KeyValue> {
        let mut v = self.attrs.to_vec();
        v.push(KeyValue::new("onceflow.outcome", outcome));
        v
    }

    /// Records per-partition lag on the `onceflow.lag` gauge.
    pub fn record_lag(&self, lag: &[PartitionLag]) {
        for l in lag {
            let mut attrs = self.attrs.to_vec();
            attrs.push(KeyValue::new(
                "messaging.destination.name",
                l.partition.topic.clone(),
            ));
            attrs.push(KeyValue::new(
                "messaging.destination.partition.id",
                l.partition.partition.to_string(),
            ));
            self.otel.lag.record(l.messages, &attrs);
        }
    }

    /// Current counter values.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let c = &self.counts;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            consumed: l(&c.consumed),
            processed: l(&c.processed),
            duplicates_skipped: l(&c.duplicates_skipped),
            handler_errors: l(&c.handler_errors),
            retries: l(&c.retries),
            dead_lettered: l(&c.dead_lettered),
            redelivery_requests: l(&c.redelivery_requests),
            transactions_committed: l(&c.transactions_committed),
            transactions_aborted: l(&c.transactions_aborted),
            rebalances: l(&c.rebalances),
            fenced: l(&c.fenced),
            commits: l(&c.commits),
            produced: l(&c.produced),
            malformed_traceparents: l(&c.malformed_traceparents),
            keyless: l(&c.keyless),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up() {
        let m = Metrics::new("memory", "g");
        m.add(Metric::Consumed, 3);
        m.add(Metric::DuplicateSkipped, 1);
        m.add(Metric::TransactionCommitted, 2);
        m.add(Metric::MalformedTraceparent, 1);
        let s = m.snapshot();
        assert_eq!(s.malformed_traceparents, 1);
        assert_eq!(s.consumed, 3);
        assert_eq!(s.duplicates_skipped, 1);
        assert_eq!(s.transactions_committed, 2);
        assert_eq!(s.processed, 0);
        let fields = s.fields();
        assert_eq!(fields[0], ("consumed", 3));
        assert!(fields.contains(&("malformed_traceparents", 1)));
        let mut names: Vec<&str> = fields.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), fields.len(), "a counter named twice");
    }

    #[test]
    fn send_retries_add_up_per_platform_across_producers() {
        // A platform name of this test's own: other tests count on the real ones.
        let before = send_retries("metrics-test");
        let a = SendRetries::new("metrics-test");
        let b = SendRetries::new("metrics-test");
        a.add(2);
        b.add(1);
        a.add(0);
        assert_eq!(send_retries("metrics-test") - before, 3);
        assert_eq!(send_retries("no-such-platform"), 0);
    }
}
