//! Publishing with `Nats-Msg-Id` dedup and atomic batches.

use std::future::IntoFuture;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::header::HeaderMap;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_trait::async_trait;
use bytes::Bytes;
use onceflow_core::{
    Capabilities, Delivery, Error, ErrorKind, Position, ProducerBackend, ProducerConfig, Record,
    Result,
};

use crate::convert::record_headers;
use crate::naming;
use crate::{Shared, CAPABILITIES};

/// Largest atomic batch nats-server accepts (ADR-50).
pub const MAX_ATOMIC_BATCH: usize = 1000;

/// A JetStream producer. Every record carries `Nats-Msg-Id` (see the crate docs).
pub struct JetStreamProducer {
    shared: Arc<Shared>,
    idempotent: bool,
    timeout: Duration,
    retries: u32,
    round_robin: AtomicU32,
}

/// A record routed to its subject, with its headers built.
struct Prepared {
    topic: String,
    partition: i32,
    subject: String,
    headers: HeaderMap,
    payload: Bytes,
    /// The `Nats-Msg-Id`, and whether onceflow generated it (no idempotency key).
    msg_id: Option<(String, bool)>,
}

fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn publish_err(subject: &str, e: async_nats::jetstream::context::PublishError) -> Error {
    let kind = match e.kind() {
        PublishErrorKind::TimedOut => ErrorKind::Timeout,
        PublishErrorKind::StreamNotFound => ErrorKind::NotFound,
        PublishErrorKind::BrokenPipe => ErrorKind::Connect,
        PublishErrorKind::MaxPayloadExceeded => ErrorKind::Config,
        PublishErrorKind::MaxAckPending => ErrorKind::Timeout,
        _ => ErrorKind::Platform,
    };
    let mut err = Error::new(kind, format!("publishing to '{subject}': {e}")).with_source(e);
    if kind == ErrorKind::Timeout {
        err = err.with_outcome_unknown();
    }
    err
}

impl JetStreamProducer {
    pub(crate) fn new(shared: Arc<Shared>, config: ProducerConfig) -> Result<Self> {
        let mut timeout = shared.options.publish_timeout;
        let mut retries = shared.options.publish_retries;
        for (k, v) in &config.options {
            match k.as_str() {
                "publish_timeout_ms" => {
                    timeout =
                        Duration::from_millis(v.parse().map_err(|_| {
                            Error::config(format!("'{k}={v}': expected milliseconds"))
                        })?)
                }
                "publish_retries" => {
                    retries = v
                        .parse()
                        .map_err(|_| Error::config(format!("'{k}={v}': expected a count")))?
                }
                _ => {
                    return Err(Error::config(format!(
                        "unknown JetStream producer option '{k}': expected publish_timeout_ms \
                         or publish_retries"
                    )))
                }
            }
        }
        if config.transactional_id.is_some() {
            tracing::debug!("transactional_id is ignored on JetStream (no transactions)");
        }
        Ok(JetStreamProducer {
            shared,
            idempotent: config.idempotent.unwrap_or(true),
            timeout,
            retries,
            round_robin: AtomicU32::new(rand::random::<u32>() % 1024),
        })
    }

    async fn prepare(&self, record: Record) -> Result<Prepared> {
        let size = record.size_bytes();
        let limit = self.shared.max_record_bytes();
        if size > limit {
            return Err(Error::config(format!(
                "record for topic '{}' is {size} bytes (key + payload + headers): the limit on \
                 jetstream is {limit} bytes (server max_payload minus room for onceflow's headers)",
                record.topic
            )));
        }
        let n = self.shared.partitions(&record.topic).await?;
        let partition = match (record.partition, &record.key) {
            (Some(p), _) => {
                if p < 0 || p as u32 >= n {
                    return Err(Error::config(format!(
                        "partition {p} of topic '{}' does not exist: expected 0..{}",
                        record.topic,
                        n - 1
                    )));
                }
                p
            }
            (None, Some(k)) => naming::partition_for_key(k, n),
            (None, None) => (self.round_robin.fetch_add(1, Ordering::Relaxed) % n) as i32,
        };
        let msg_id = match &record.idempotency_key {
            Some(k) => Some((k.clone(), false)),
            None if self.idempotent => Some((random_id(), true)),
            None => None,
        };
        let headers = record_headers(&record, msg_id.as_ref().map(|(id, _)| id.as_str()))?;
        Ok(Prepared {
            subject: naming::subject(&record.topic, n, partition),
            topic: record.topic,
            partition,
            headers,
            payload: record.payload,
            msg_id,
        })
    }

    async fn start(&self, p: &Prepared) -> Result<PublishAckFuture> {
        self.shared
            .js
            .send_publish(
                p.subject.clone(),
                PublishMessage::build()
                    .payload(p.payload.clone())
                    .headers(p.headers.clone()),
            )
            .await
            .map_err(|e| publish_err(&p.subject, e))
    }

    async fn wait(&self, p: &Prepared, fut: PublishAckFuture) -> Result<PublishAck> {
        match tokio::time::timeout(self.timeout, fut.into_future()).await {
            Ok(r) => r.map_err(|e| publish_err(&p.subject, e)),
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "publishing to '{}': no ack within {:?}",
                    p.subject, self.timeout
                ),
            )
            .with_outcome_unknown()),
        }
    }

    fn delivery(&self, p: &Prepared, ack: PublishAck, retried: bool) -> Delivery {
        // A duplicate ack for a retry of an id onceflow generated can only be our own earlier
        // attempt: the record is written once, not a duplicate of someone else's.
        let own_retry = retried && matches!(p.msg_id, Some((_, true)));
        Delivery {
            topic: p.topic.clone(),
            partition: p.partition,
            position: Position::Sequence(ack.sequence),
            timestamp: None,
            duplicate: ack.duplicate && !own_retry,
        }
    }

    /// Publishes and waits for the ack; a timeout is retried with the same `Nats-Msg-Id`.
    async fn publish(&self, p: &Prepared, first: Option<Result<PublishAck>>) -> Result<Delivery> {
        let mut attempt = 0u32;
        let mut result = match first {
            Some(r) => r,
            None => match self.start(p).await {
                Ok(f) => self.wait(p, f).await,
                Err(e) => Err(e),
            },
        };
        loop {
            match result {
                Ok(ack) => return Ok(self.delivery(p, ack, attempt > 0)),
                Err(e)
                    if e.kind() == ErrorKind::Timeout
                        && p.msg_id.is_some()
                        && attempt < self.retries =>
                {
                    attempt += 1;
                    tracing::debug!(subject = %p.subject, attempt, "publish timed out; retrying with the same Nats-Msg-Id");
                    result = match self.start(p).await {
                        Ok(f) => self.wait(p, f).await,
                        Err(e) => Err(e),
                    };
                }
                Err(e) => {
                    if e.kind() == ErrorKind::NotFound {
                        self.shared.forget_topic(&p.topic);
                    }
                    return Err(e);
                }
            }
        }
    }
}

#[async_trait]
impl ProducerBackend for JetStreamProducer {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            idempotent_producer: self.idempotent,
            ..CAPABILITIES
        }
    }

    async fn send(&self, record: Record) -> Result<Delivery> {
        let p = self.prepare(record).await?;
        self.publish(&p, None).await
    }

    /// Publishes every record before waiting for the first ack (async publish, bounded by
    /// async-nats' in-flight ack limit); a timed-out one is retried with its `Nats-Msg-Id`.
    async fn send_batch(&self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        let mut started: Vec<Result<(Prepared, Option<PublishAckFuture>)>> =
            Vec::with_capacity(records.len());
        for r in records {
            let s = match self.prepare(r).await {
                Ok(p) => match self.start(&p).await {
                    Ok(f) => Ok((p, Some(f))),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            started.push(s);
        }
        let mut out = Vec::with_capacity(started.len());
        for s in started {
            out.push(match s {
                Ok((p, Some(f))) => {
                    let first = self.wait(&p, f).await;
                    self.publish(&p, Some(first)).await
                }
                Ok((p, None)) => self.publish(&p, None).await,
                Err(e) => Err(e),
            });
        }
        out
    }

    /// Atomic batch publish (ADR-50): every record but the last is published with
    /// `Nats-Batch-Id` and `Nats-Batch-Sequence`, the last also with `Nats-Batch-Commit: 1`;
    /// the server stores all of them or none and acks the commit. All records must go to one
    /// topic (one stream), at most 1000.
    async fn send_atomic(&self, records: Vec<Record>) -> Result<Vec<Delivery>> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        if records.len() > MAX_ATOMIC_BATCH {
            return Err(Error::config(format!(
                "atomic batch of {} records: JetStream accepts at most {MAX_ATOMIC_BATCH}",
                records.len()
            )));
        }
        let topic = records[0].topic.clone();
        if let Some(other) = records.iter().find(|r| r.topic != topic) {
            return Err(Error::unsupported(format!(
                "atomic batch spans topics '{topic}' and '{}': a JetStream atomic batch writes \
                 to one stream",
                other.topic
            )));
        }
        let mut prepared = Vec::with_capacity(records.len());
        for r in records {
            prepared.push(self.prepare(r).await?);
        }
        let batch_id = random_id();
        let n = prepared.len();
        let client = &self.shared.client;
        for (i, p) in prepared.iter_mut().enumerate() {
            p.headers
                .insert(async_nats::header::NATS_BATCH_ID, batch_id.as_str());
            p.headers.insert(
                async_nats::header::NATS_BATCH_SEQUENCE,
                (i + 1).to_string().as_str(),
            );
            if i + 1 == n {
                p.headers.insert(async_nats::header::NATS_BATCH_COMMIT, "1");
            }
        }
        // The first message carries a reply subject: the server answers it only with an error
        // (an unknown stream, atomic publish disabled), which the commit ack reports too.
        for p in &prepared[..n - 1] {
            client
                .publish_with_headers(p.subject.clone(), p.headers.clone(), p.payload.clone())
                .await
                .map_err(|e| {
                    Error::new(
                        ErrorKind::Connect,
                        format!("publishing atomic batch {batch_id} to '{}': {e}", p.subject),
                    )
                    .with_source(e)
                })?;
        }
        let last = &prepared[n - 1];
        let ack = match self.start(last).await {
            Ok(f) => self.wait(last, f).await,
            Err(e) => Err(e),
        }
        .map_err(|e| {
            let lower = e.message().to_lowercase();
            if lower.contains("atomic")
                && (lower.contains("disabled") || lower.contains("not enabled"))
            {
                Error::unsupported(format!(
                    "stream '{topic}' does not allow atomic batch publish (create it with \
                     allow_atomic): {}",
                    e.message()
                ))
            } else {
                e.context(format!("atomic batch {batch_id} of {n} records"))
            }
        })?;
        let last_seq = ack.sequence;
        let first_seq = last_seq + 1 - n as u64;
        Ok(prepared
            .iter()
            .enumerate()
            .map(|(i, p)| Delivery {
                topic: p.topic.clone(),
                partition: p.partition,
                position: Position::Sequence(first_seq + i as u64),
                timestamp: None,
                duplicate: false,
            })
            .collect())
    }

    async fn flush(&self, timeout: Duration) -> Result<()> {
        match tokio::time::timeout(timeout, self.shared.client.flush()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                Err(Error::new(ErrorKind::Connect, format!("flushing: {e}")).with_source(e))
            }
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!("flush did not finish within {timeout:?}"),
            )),
        }
    }

    async fn close(&self) -> Result<()> {
        self.flush(self.timeout).await
    }
}
