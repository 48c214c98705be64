//! Enhanced fan-out: the registered stream consumer, and the SubscribeToShard fetch loop that
//! feeds the same [`Pipe`] as GetRecords polling.
//!
//! AWS references: [RegisterStreamConsumer], [DescribeStreamConsumer], [SubscribeToShard],
//! [SubscribeToShardEvent].
//!
//! [RegisterStreamConsumer]: https://docs.aws.amazon.com/kinesis/latest/APIReference/API_RegisterStreamConsumer.html
//! [DescribeStreamConsumer]: https://docs.aws.amazon.com/kinesis/latest/APIReference/API_DescribeStreamConsumer.html
//! [SubscribeToShard]: https://docs.aws.amazon.com/kinesis/latest/APIReference/API_SubscribeToShard.html
//! [SubscribeToShardEvent]: https://docs.aws.amazon.com/kinesis/latest/APIReference/API_SubscribeToShardEvent.html

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use aws_sdk_kinesis::config::http::HttpResponse;
use aws_sdk_kinesis::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_kinesis::primitives::DateTime;
use aws_sdk_kinesis::types::{
    ConsumerStatus, ShardIteratorType, StartingPosition, SubscribeToShardEventStream,
};
use onceflow_core::{Error, ErrorKind, Result};
use tokio::time::Instant;

use crate::config::FanOut;
use crate::consumer::{poll_shard, Pipe, Spec};
use crate::shards::aws_err;
use crate::Shared;

/// How long registering a stream consumer may take until it is ACTIVE.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(60);

/// Pause after a subscription refused with `ResourceInUseException`: AWS refuses a second
/// SubscribeToShard for the same consumer and shard within 5 s of the previous one, and a
/// server may hold a dropped subscription until it notices the closed connection.
const IN_USE_PAUSE: Duration = Duration::from_secs(1);

/// The least time between two shard-end checks of a closed shard (see [`run`]).
const END_CHECK_EVERY: Duration = Duration::from_secs(1);

/// The enhanced fan-out state of one consumer: the mode asked for and whether `auto` fell
/// back to polling.
pub(crate) struct EfoMode {
    pub(crate) mode: FanOut,
    /// Set once when `auto` found the server without enhanced fan-out (logged then).
    pub(crate) off: AtomicBool,
}

impl EfoMode {
    pub(crate) fn new(mode: FanOut) -> Self {
        EfoMode {
            mode,
            off: AtomicBool::new(false),
        }
    }

    /// Whether new fetchers subscribe (enhanced fan-out still on).
    pub(crate) fn active(&self) -> bool {
        self.mode != FanOut::Poll && !self.off.load(Ordering::Acquire)
    }

    /// `auto`: turns enhanced fan-out off, logging the reason once.
    /// `efo`: the `Unsupported` error to report.
    pub(crate) fn unsupported(&self, reason: &str) -> Option<Error> {
        match self.mode {
            FanOut::Auto => {
                if !self.off.swap(true, Ordering::AcqRel) {
                    tracing::warn!(
                        "Kinesis enhanced fan-out is not available ({reason}): fan_out=auto \
                         falls back to GetRecords polling"
                    );
                }
                None
            }
            _ => Some(Error::unsupported(format!(
                "Kinesis enhanced fan-out (fan_out=efo) is not available: {reason}; use \
                 fan_out=poll, or fan_out=auto to fall back to polling"
            ))),
        }
    }
}

/// Why an answer means the server has no such operation (kinesalite answers
/// `UnknownOperationException`; other servers 404 / 501); `None` for any other error.
pub(crate) fn unsupported_reason<E>(op: &str, e: &SdkError<E, HttpResponse>) -> Option<String>
where
    E: ProvideErrorMetadata,
{
    let status = e.raw_response().map(|r| r.status().as_u16());
    let code = match e {
        SdkError::ServiceError(se) => se.err().code().map(String::from),
        _ => None,
    };
    match (code.as_deref(), status) {
        (
            Some(
                c @ ("UnknownOperationException"
                | "UnknownOperation"
                | "InvalidAction"
                | "NotImplemented"
                | "UnsupportedOperation"
                | "UnsupportedOperationException"),
            ),
            _,
        ) => Some(format!("the server answered {op} with {c}")),
        (_, Some(s @ (404 | 405 | 501))) => Some(format!("the server answered {op} with HTTP {s}")),
        _ => None,
    }
}

/// The ARN of the stream consumer `name` of `stream`, registered if missing
/// (RegisterStreamConsumer) and waited for until `ACTIVE` (DescribeStreamConsumer, at most
/// 60 s). An existing consumer of that name is reused; one being deleted is waited for and
/// registered again. `Unsupported` (via [`EfoMode::unsupported`]) when the server has no such
/// operation; `Ok(None)` then for `auto`.
pub(crate) async fn stream_consumer(
    shared: &Shared,
    efo: &EfoMode,
    stream: &str,
    name: &str,
) -> Result<Option<String>> {
    let summary = shared
        .client
        .describe_stream_summary()
        .stream_name(stream)
        .send()
        .await
        .map_err(|e| aws_err(format!("DescribeStreamSummary of '{stream}'"), e))?;
    let stream_arn = summary
        .stream_description_summary()
        .map(|s| s.stream_arn().to_string())
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Platform,
                format!("Kinesis DescribeStreamSummary of '{stream}': no stream ARN"),
            )
        })?;
    let deadline = Instant::now() + REGISTER_TIMEOUT;
    loop {
        let described = shared
            .client
            .describe_stream_consumer()
            .stream_arn(&stream_arn)
            .consumer_name(name)
            .send()
            .await;
        let status = match described {
            Ok(d) => d
                .consumer_description()
                .map(|c| (c.consumer_arn().to_string(), c.consumer_status().clone())),
            Err(e) => {
                if let Some(reason) = unsupported_reason("DescribeStreamConsumer", &e) {
                    return match efo.unsupported(&reason) {
                        Some(err) => Err(err),
                        None => Ok(None),
                    };
                }
                let not_found = e
                    .as_service_error()
                    .is_some_and(|s| s.is_resource_not_found_exception());
                if !not_found {
                    return Err(aws_err(
                        format!("DescribeStreamConsumer '{name}' of '{stream}'"),
                        e,
                    ));
                }
                None
            }
        };
        match status {
            Some((arn, ConsumerStatus::Active)) => return Ok(Some(arn)),
            // Creating, or being deleted: wait, then look again.
            Some(_) => {}
            None => {
                let r = shared
                    .client
                    .register_stream_consumer()
                    .stream_arn(&stream_arn)
                    .consumer_name(name)
                    .send()
                    .await;
                if let Err(e) = r {
                    if let Some(reason) = unsupported_reason("RegisterStreamConsumer", &e) {
                        return match efo.unsupported(&reason) {
                            Some(err) => Err(err),
                            None => Ok(None),
                        };
                    }
                    // Another member registered it first: describe again.
                    let in_use = e
                        .as_service_error()
                        .is_some_and(|s| s.is_resource_in_use_exception());
                    if !in_use {
                        return Err(aws_err(
                            format!("RegisterStreamConsumer '{name}' of '{stream}'"),
                            e,
                        ));
                    }
                } else {
                    tracing::info!(
                        stream,
                        consumer = name,
                        "registered a stream consumer for enhanced fan-out"
                    );
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "stream consumer '{name}' of '{stream}' not ACTIVE after {} s",
                    REGISTER_TIMEOUT.as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn starting_position(spec: &Spec) -> StartingPosition {
    let b = StartingPosition::builder();
    let b = match spec {
        Spec::TrimHorizon => b.r#type(ShardIteratorType::TrimHorizon),
        Spec::Latest => b.r#type(ShardIteratorType::Latest),
        Spec::At(s) => b
            .r#type(ShardIteratorType::AtSequenceNumber)
            .sequence_number(s),
        Spec::After(s) => b
            .r#type(ShardIteratorType::AfterSequenceNumber)
            .sequence_number(s),
        Spec::Time(ts) => b
            .r#type(ShardIteratorType::AtTimestamp)
            .timestamp(DateTime::from_millis(*ts)),
    };
    b.build().expect("the type is always set")
}

/// Reads one shard through SubscribeToShard into its pipe, until the shard ends or the fetch
/// is no longer current (lease lost, seek, nack, close).
///
/// - The first subscription starts at `spec`; every later one (the subscription ends after
///   5 minutes, or the connection dropped, or the server sent an error event) starts
///   `AFTER_SEQUENCE_NUMBER` the last `ContinuationSequenceNumber` (the position after
///   everything delivered, even with no records), else after the last record fetched, else
///   at `spec` (`LATEST` becomes `AT_TIMESTAMP` of the first subscription).
/// - `MillisBehindLatest` of each event is the shard's lag.
/// - **Shard end**: an event with `ChildShards` (and no `ContinuationSequenceNumber`) ends
///   the shard, as AWS sends it. A server that never sends `ChildShards` (kinesis-local 0.6.2
///   keeps sending empty events on a closed shard) is handled too: when an event is empty and
///   ListShards (the group's coordination) reports the shard closed, one GetShardIterator
///   (`AFTER_SEQUENCE_NUMBER` the continuation) + GetRecords confirms the end (no records, no
///   next iterator), at most once a second.
/// - `ResourceInUseException` (a subscription of this consumer and shard is still open, or was
///   opened less than 5 s ago) waits a second and subscribes again; other errors back off.
/// - A server without SubscribeToShard: `fan_out=efo` reports `Unsupported` through the next
///   `poll`; `fan_out=auto` logs once and reads this shard by polling from here on.
pub(crate) async fn run(mut pipe: Pipe, mut spec: Spec, consumer_arn: String, efo: &EfoMode) {
    let idle = pipe.shared.options.idle;
    let mut continuation: Option<String> = None;
    let mut failures = 0u32;
    let mut last_end_check: Option<Instant> = None;
    'subscribe: loop {
        if !pipe.room().await {
            return;
        }
        let start = match &continuation {
            Some(c) => Spec::After(c.clone()),
            None => pipe.resume_spec(&mut spec),
        };
        let sent = pipe
            .shared
            .client
            .subscribe_to_shard()
            .consumer_arn(&consumer_arn)
            .shard_id(&pipe.shard)
            .starting_position(starting_position(&start))
            .send()
            .await;
        let mut events = match sent {
            Ok(out) => out.event_stream,
            Err(e) => {
                if let Some(reason) = unsupported_reason("SubscribeToShard", &e) {
                    match efo.unsupported(&reason) {
                        Some(err) => pipe.fail(err),
                        None => poll_shard(pipe, start).await,
                    }
                    return;
                }
                let in_use = e
                    .as_service_error()
                    .is_some_and(|s| s.is_resource_in_use_exception());
                if in_use {
                    tracing::debug!(partition = %pipe.tp, "SubscribeToShard: a subscription is still open; retrying");
                    tokio::time::sleep(IN_USE_PAUSE).await;
                    continue;
                }
                let err = aws_err(format!("SubscribeToShard of {}", pipe.tp), e);
                failures += 1;
                tracing::warn!(partition = %pipe.tp, "{err}");
                tokio::time::sleep(idle * failures.min(20)).await;
                continue;
            }
        };
        let mut got_event = false;
        loop {
            if !pipe.room().await {
                return;
            }
            let ev = match events.recv().await {
                Ok(Some(SubscribeToShardEventStream::SubscribeToShardEvent(ev))) => ev,
                Ok(Some(other)) => {
                    tracing::warn!(partition = %pipe.tp, "SubscribeToShard: unknown event {other:?}; subscribing again");
                    continue 'subscribe;
                }
                // The subscription ended (after 5 minutes): subscribe again from the
                // continuation; one that ended before any event backs off first.
                Ok(None) => {
                    tracing::debug!(partition = %pipe.tp, "subscription ended; subscribing again");
                    if !got_event {
                        failures += 1;
                        tokio::time::sleep(idle * failures.min(20)).await;
                    }
                    continue 'subscribe;
                }
                Err(e) => {
                    let in_use = e.as_service_error().is_some_and(|s| {
                        matches!(
                            s,
                            aws_sdk_kinesis::types::error::SubscribeToShardEventStreamError::ResourceInUseException(_)
                        )
                    });
                    if in_use {
                        tokio::time::sleep(IN_USE_PAUSE).await;
                    } else {
                        let err =
                            aws_err(format!("SubscribeToShard event stream of {}", pipe.tp), e);
                        failures += 1;
                        tracing::warn!(partition = %pipe.tp, "{err}; subscribing again");
                        tokio::time::sleep(idle * failures.min(20)).await;
                    }
                    continue 'subscribe;
                }
            };
            failures = 0;
            got_event = true;
            let millis = u64::try_from(ev.millis_behind_latest()).ok();
            // At shard end AWS sends the child shards and no continuation (the SDK reads a
            // missing one as "").
            let next = Some(ev.continuation_sequence_number()).filter(|c| !c.is_empty());
            let ended = !ev.child_shards().is_empty() || next.is_none();
            let empty = ev.records().is_empty();
            if !pipe.deliver(ev.records(), millis, ended) {
                return;
            }
            if let Some(c) = next {
                continuation = Some(c.to_string());
            }
            if ended {
                tracing::debug!(partition = %pipe.tp, children = ev.child_shards().len(), "shard end (SubscribeToShard)");
                return;
            }
            let due = last_end_check.is_none_or(|t| t.elapsed() >= END_CHECK_EVERY);
            if empty && due && pipe.closed() {
                last_end_check = Some(Instant::now());
                match pipe.at_end(continuation.as_deref()).await {
                    Ok(true) => {
                        tracing::debug!(partition = %pipe.tp, "shard end (closed shard read to its end)");
                        pipe.mark_ended();
                        return;
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(partition = %pipe.tp, "shard end check: {e}"),
                }
            }
        }
    }
}
