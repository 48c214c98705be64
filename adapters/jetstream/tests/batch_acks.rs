//! The JetStream producer's batches under faults (#28, found by a break-it pass on 4d093d9
//! and 00e6f68): a batch larger than async-nats' ack limit, producer options out of range,
//! and a frozen server's lost acks reported with their true outcome.
//! Runs when `ONCEFLOW_NATS_URL` is set (the private-server tests need the harness' binary).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use onceflow_core::{Client, ConsumerConfig, PlatformBackend, ProducerConfig, Record};

mod common;
use common::{name, platform, take, topic, PrivateServer};

async fn stored(p: &onceflow_jetstream::JetStreamPlatform, t: &str) -> u64 {
    let d = p.admin().await.unwrap().describe_topic(t).await.unwrap();
    d.options["messages"].parse().unwrap()
}

/// A healthy server, one `send_batch` of 10 000 records (more than async-nats' 5 000 acks
/// pending per connection): every record is delivered. Seen on 300c0ce: the records past the
/// 5 000th wait for an ack permit that only the batch's own (not yet awaited) acks give back,
/// so after one publish timeout each fails "took no publish within 5s ... nothing was sent".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_the_ack_limit_is_delivered_on_a_healthy_server() {
    let test = "a_batch_larger_than_the_ack_limit_is_delivered_on_a_healthy_server";
    let Some(p) = platform(test).await else {
        return;
    };
    let t = topic(&p, "bk28-big", 1).await;
    let client = Client::new(p.clone());
    let producer = client.producer(ProducerConfig::default()).await.unwrap();
    let n = 10_000;
    let records: Vec<Record> = (0..n)
        .map(|i| Record::new(t.clone(), format!("m{i}")).idempotency_key(format!("k-{i}")))
        .collect();
    let started = Instant::now();
    let results = producer.send_batch(records).await;
    let took = started.elapsed();
    let failed: Vec<(usize, String)> = results
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.as_ref().err().map(|e| (i, e.to_string())))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {n} records of a healthy server's batch failed in {took:?}; first: {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(stored(&p, &t).await, n as u64);
}

/// `publish_timeout_ms` among a producer's options (not the URL, which checks it): a value the
/// URL refuses must not panic the send (`Instant + Duration` overflows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_publish_timeout_out_of_range_is_refused_not_a_panic() {
    let test = "a_producer_publish_timeout_out_of_range_is_refused_not_a_panic";
    let Some(p) = platform(test).await else {
        return;
    };
    let t = topic(&p, "bk28-timeout", 1).await;
    for value in [u64::MAX.to_string(), "0".to_string()] {
        let client = Client::new(p.clone());
        let mut config = ProducerConfig::default();
        config
            .options
            .insert("publish_timeout_ms".into(), value.clone());
        let producer = match client.producer(config).await {
            // Refused as the URL refuses it: fine.
            Err(e) => {
                assert!(e.to_string().contains("publish_timeout_ms"), "{e}");
                continue;
            }
            Ok(producer) => producer,
        };
        let t2 = t.clone();
        let outcome = tokio::spawn(async move {
            let batch = producer
                .send_batch(vec![Record::new(t2.clone(), "b").idempotency_key("b")])
                .await;
            let one = producer
                .send(Record::new(t2, "s").idempotency_key("s"))
                .await;
            (batch, one)
        })
        .await;
        let (batch, one) = match outcome {
            Ok(r) => r,
            Err(e) => panic!("publish_timeout_ms={value}: the send panicked: {e}"),
        };
        // Accepted: then it must work like any timeout (the server is healthy).
        assert!(
            batch[0].is_ok(),
            "publish_timeout_ms={value}: {:?}",
            batch[0]
        );
        assert!(one.is_ok(), "publish_timeout_ms={value}: {one:?}");
    }
}

/// A frozen server (SIGSTOP: connections open, nothing answered) under a batch whose records
/// fill the socket: a record whose first publish went to the connection may be stored once
/// the server runs again, so its error must say its outcome is unknown, never "nothing was
/// sent". Checked after SIGCONT against what the stream holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_servers_batch_reports_no_stored_record_as_not_sent() {
    let test = "a_frozen_servers_batch_reports_no_stored_record_as_not_sent";
    if platform(test).await.is_none() {
        return;
    }
    let Some(mut server) = PrivateServer::new(test) else {
        return;
    };
    server.start(true).await;
    let url = format!("{}?publish_timeout_ms=1000&publish_retries=2", server.url());
    let p = onceflow_jetstream::connect(&url).await.unwrap();
    let t = topic(&p, "bk28-frozen", 1).await;
    let client = Client::new(p.clone());
    let producer = client.producer(ProducerConfig::default()).await.unwrap();
    producer
        .send(Record::new(t.clone(), "first").idempotency_key("first"))
        .await
        .unwrap();
    // 2 000 records of 16 KiB: 32 MiB, more than loopback's socket buffers hold.
    let n = 2000;
    let body = "x".repeat(16 * 1024);
    let records: Vec<Record> = (0..n)
        .map(|i| Record::new(t.clone(), format!("m{i}:{body}")).idempotency_key(format!("k-{i}")))
        .collect();
    server.freeze(true);
    let started = Instant::now();
    let results = producer.send_batch(records).await;
    let took = started.elapsed();
    server.freeze(false);
    // Let the server read what was buffered for it, then read the stream.
    tokio::time::sleep(Duration::from_secs(5)).await;
    common::reconnected(&p).await;
    let held = stored(&p, &t).await as usize;
    let c = p
        .consumer(ConsumerConfig::new(name("g"), [t.clone()]))
        .await
        .unwrap();
    let got = take(c.as_ref(), held).await;
    c.close().await.unwrap();
    let mut in_stream: HashMap<String, usize> = HashMap::new();
    for m in &got {
        let body = String::from_utf8_lossy(&m.payload);
        let id = body.split(':').next().unwrap().to_string();
        *in_stream.entry(id).or_default() += 1;
    }
    let mut ok = 0;
    let mut unknown = 0;
    let mut not_sent = Vec::new();
    let mut not_sent_but_stored = Vec::new();
    let mut ok_but_absent = Vec::new();
    for (i, r) in results.iter().enumerate() {
        let id = format!("m{i}");
        match r {
            Ok(_) => {
                ok += 1;
                if !in_stream.contains_key(&id) {
                    ok_but_absent.push(i);
                }
            }
            Err(e) if e.outcome_unknown() => unknown += 1,
            Err(e) => {
                not_sent.push(i);
                if in_stream.contains_key(&id) {
                    not_sent_but_stored.push((i, e.to_string()));
                }
            }
        }
    }
    let dups = in_stream.values().filter(|&&c| c > 1).count();
    eprintln!(
        "{test}: send_batch took {took:?}; ok={ok} outcome_unknown={unknown} not_sent={} \
         stream={} (distinct {}), duplicated={dups}",
        not_sent.len(),
        got.len(),
        in_stream.len()
    );
    assert!(
        ok_but_absent.is_empty(),
        "reported delivered, not in the stream: {ok_but_absent:?}"
    );
    assert_eq!(dups, 0, "records stored twice");
    assert!(
        not_sent_but_stored.is_empty(),
        "{} records reported with a known outcome (not sent) are in the stream; first: {:?}",
        not_sent_but_stored.len(),
        not_sent_but_stored.first()
    );
}

/// `send_atomic` on a frozen server whose connection takes nothing more (its command channel
/// full of publishes the socket cannot write): it must fail within about a publish timeout,
/// as `send` and `send_batch` now do (4d093d9), not wait for room without bound. Seen on
/// 300c0ce: 58.9 s with a publish timeout of 1 s (ended only when the client's own pings gave
/// the connection up): the records before the commit go through
/// `Client::publish_with_headers`, awaited with no bound; only the last, committing one is
/// queued by the publish timeout. The pipeline sends a transform's outputs this way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_atomic_batch_on_a_frozen_server_ends_within_its_publish_timeout() {
    atomic_batch_after_a_full_connection(
        "an_atomic_batch_on_a_frozen_server_ends_within_its_publish_timeout",
        Stop::Freeze,
    )
    .await;
}

/// The same on a server that died (SIGKILL, not restarted): the client reconnects without end
/// and its command channel, once full, takes nothing. `send_atomic` must still fail within
/// about a publish timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_atomic_batch_on_a_dead_server_ends_within_its_publish_timeout() {
    atomic_batch_after_a_full_connection(
        "an_atomic_batch_on_a_dead_server_ends_within_its_publish_timeout",
        Stop::Kill,
    )
    .await;
}

/// How the private server stops answering.
#[derive(Clone, Copy, Debug)]
enum Stop {
    /// SIGSTOP (connections stay open), SIGCONT after the atomic batch.
    Freeze,
    /// SIGKILL, not restarted.
    Kill,
}

/// A private server that stops answering (`stop`) after an atomic batch went through; a batch
/// of 3 000 records of 16 KiB fills the socket and the connection's command channel; then an
/// atomic batch of two must fail within about the publish timeout of 1 s.
async fn atomic_batch_after_a_full_connection(test: &str, stop: Stop) {
    if platform(test).await.is_none() {
        return;
    }
    let Some(mut server) = PrivateServer::new(test) else {
        return;
    };
    server.start(true).await;
    let url = format!("{}?publish_timeout_ms=1000&publish_retries=0", server.url());
    let p = onceflow_jetstream::connect(&url).await.unwrap();
    let t = topic(&p, "bk28-atomic", 1).await;
    let client = Client::new(p.clone());
    let producer = client.producer(ProducerConfig::default()).await.unwrap();
    let two = |tag: &str| {
        (0..2)
            .map(|i| {
                Record::new(t.clone(), format!("{tag}{i}")).idempotency_key(format!("{tag}{i}"))
            })
            .collect::<Vec<_>>()
    };
    // Atomic batches work on this stream while the server runs.
    producer.send_atomic(two("ok")).await.unwrap();
    match stop {
        Stop::Freeze => server.freeze(true),
        Stop::Kill => server.kill(),
    }
    let body = "x".repeat(16 * 1024);
    let fill: Vec<Record> = (0..3000)
        .map(|i| Record::new(t.clone(), format!("f{i}:{body}")).idempotency_key(format!("f{i}")))
        .collect();
    let failed = producer
        .send_batch(fill)
        .await
        .iter()
        .filter(|r| r.is_err())
        .count();
    eprintln!("{test}: {failed} of 3000 filler records failed ({stop:?})");
    let started = Instant::now();
    let atomic =
        tokio::time::timeout(Duration::from_secs(60), producer.send_atomic(two("at"))).await;
    let took = started.elapsed();
    if let Stop::Freeze = stop {
        server.freeze(false);
    }
    let result = atomic.unwrap_or_else(|_| {
        panic!("send_atomic ({stop:?}) did not end in 60 s (publish timeout 1 s)")
    });
    assert!(
        result.is_err(),
        "a stopped server ({stop:?}) acknowledged an atomic batch: {result:?}"
    );
    assert!(
        took < Duration::from_secs(15),
        "send_atomic ({stop:?}) took {took:?} (publish timeout 1 s)"
    );
}

/// A batch whose server freezes for 2 s mid-batch, with `publish_retries=3` and a publish
/// timeout of 1 s: the records the connection took nothing of in time are retried as `send`
/// retries them, and go through once the server runs again. A break-it pass saw 10 137 of
/// 20 000 fail "nothing was sent" half a second after the server was back: `send_batch` retried
/// only the records whose ack was lost (#28).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_a_short_freeze_retries_what_it_could_not_queue() {
    let test = "a_batch_over_a_short_freeze_retries_what_it_could_not_queue";
    if platform(test).await.is_none() {
        return;
    }
    let Some(mut server) = PrivateServer::new(test) else {
        return;
    };
    server.start(true).await;
    let url = format!("{}?publish_timeout_ms=1000&publish_retries=3", server.url());
    let p = onceflow_jetstream::connect(&url).await.unwrap();
    let t = topic(&p, "bk37-freeze", 1).await;
    let client = Client::new(p.clone());
    let producer = client.producer(ProducerConfig::default()).await.unwrap();
    let n = 20_000;
    let body = "x".repeat(1000);
    let records: Vec<Record> = (0..n)
        .map(|i| Record::new(t.clone(), format!("m{i}:{body}")).idempotency_key(format!("k-{i}")))
        .collect();
    let batch = tokio::spawn(async move { producer.send_batch(records).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.freeze(true);
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.freeze(false);
    let results = batch.await.unwrap();
    let not_sent: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .filter(|e| !e.outcome_unknown())
        .map(|e| e.to_string())
        .collect();
    let unknown = results
        .iter()
        .filter(|r| r.as_ref().is_err_and(|e| e.outcome_unknown()))
        .count();
    eprintln!(
        "{test}: {} of {n} not sent, {unknown} outcome unknown",
        not_sent.len()
    );
    assert!(
        not_sent.is_empty(),
        "{} of {n} records failed 'not sent' over a 2 s freeze with 3 retries; first: {}",
        not_sent.len(),
        not_sent[0]
    );
}
