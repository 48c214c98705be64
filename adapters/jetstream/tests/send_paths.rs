//! A single send's two paths on a real nats-server: the publish handed to the connection on
//! the send's first poll (an ack permit free and room in the command channel), or, when it cannot be,
//! the async path that waits for both. Many more sends in flight than async-nats allows acks
//! pending (5 000) and than its command channel holds make most sends take the second path.
//! Runs when `ONCEFLOW_NATS_URL` is set; without it each test prints that it skipped and why.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use onceflow_core::{
    Client, ConsumerBackend, ConsumerConfig, ErrorKind, PlatformBackend, ProducerConfig, Record,
    TopicSpec, IDEMPOTENCY_KEY_HEADER,
};
use onceflow_jetstream::JetStreamPlatform;

mod common;
use common::{name, platform, take, topic, URL_VAR};

/// A second connection to the server, with `options` (`k=v&…`) on its URL.
async fn platform_with(options: &str) -> Arc<JetStreamPlatform> {
    let url = std::env::var(URL_VAR).unwrap();
    let sep = if url.contains('?') { '&' } else { '?' };
    onceflow_jetstream::connect(&format!("{url}{sep}{options}"))
        .await
        .unwrap()
}

/// A consumer group that reads a whole flood without acking (no `max_ack_pending` cap).
async fn reader(t: &str) -> Arc<dyn ConsumerBackend> {
    platform_with("max_ack_pending=-1")
        .await
        .consumer(ConsumerConfig::new(name("g"), [t.to_string()]))
        .await
        .unwrap()
}

async fn stored(p: &JetStreamPlatform, t: &str) -> u64 {
    let d = p.admin().await.unwrap().describe_topic(t).await.unwrap();
    d.options["messages"].parse().unwrap()
}

/// A record of the flood: every other one has an idempotency key (its `Nats-Msg-Id`), the
/// others get one generated; all carry a header of their own.
fn record(t: &str, i: usize) -> Record {
    let r = Record::new(t.to_string(), format!("m{i}")).header("X-Seq", i.to_string());
    if i.is_multiple_of(2) {
        r.idempotency_key(format!("k-{i}"))
    } else {
        r
    }
}

/// `n` sends through the facade, all started in one task before any is awaited to the end.
async fn flood_one_task(producer: &onceflow_core::Producer, t: &str, n: usize) -> usize {
    let sends = (0..n).map(|i| producer.send(record(t, i)));
    let deliveries = futures::future::join_all(sends).await;
    let mut positions = HashSet::new();
    for (i, d) in deliveries.into_iter().enumerate() {
        let d = d.unwrap_or_else(|e| panic!("send m{i}: {e}"));
        assert!(!d.duplicate, "m{i} flagged a duplicate");
        assert!(positions.insert(d.position), "two sends got one position");
    }
    positions.len()
}

async fn flood_and_check(test: &str, spawned: bool) {
    let Some(p) = platform(test).await else {
        return;
    };
    let t = topic(&p, "js-paths", 3).await;
    let client = Client::new(p.clone());
    let producer = Arc::new(client.producer(ProducerConfig::default()).await.unwrap());
    // The topic is looked up once; every later send finds it known.
    producer
        .send(Record::new(t.clone(), "first").partition(0))
        .await
        .unwrap();
    let n = 12_000;
    if spawned {
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let producer = producer.clone();
                let t = t.clone();
                tokio::spawn(async move { producer.send(record(&t, i)).await })
            })
            .collect();
        let mut positions = HashSet::new();
        for (i, task) in tasks.into_iter().enumerate() {
            let d = task
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("send m{i}: {e}"));
            assert!(!d.duplicate, "m{i} flagged a duplicate");
            assert!(positions.insert((d.partition, d.position)));
        }
        assert_eq!(positions.len(), n);
    } else {
        // One partition's sequences: positions are distinct per partition, so use one.
        let t1 = topic(&p, "js-paths", 1).await;
        producer
            .send(Record::new(t1.clone(), "first"))
            .await
            .unwrap();
        assert_eq!(flood_one_task(&producer, &t1, n).await, n);
        assert_eq!(stored(&p, &t1).await, n as u64 + 1);
        // The same keys again: each is a duplicate of the stored one, nothing more stored.
        let again = (0..n).step_by(2).map(|i| producer.send(record(&t1, i)));
        for d in futures::future::join_all(again).await {
            assert!(d.unwrap().duplicate);
        }
        assert_eq!(stored(&p, &t1).await, n as u64 + 1);
        let c = reader(&t1).await;
        // "first" plus the flood.
        let got = take(c.as_ref(), n + 1).await;
        assert_eq!(got.len(), n + 1);
        c.close().await.unwrap();
        // And the same flood on the three-partition topic for the read-back below.
        let sends = (0..n).map(|i| producer.send(record(&t, i)));
        for d in futures::future::join_all(sends).await {
            assert!(!d.unwrap().duplicate);
        }
    }
    assert_eq!(stored(&p, &t).await, n as u64 + 1);
    // The read-back skips "first".
    let c = reader(&t).await;
    let all = take(c.as_ref(), n + 1).await;
    c.close().await.unwrap();
    assert_eq!(all.len(), n + 1);
    let mut seen: HashMap<String, usize> = HashMap::new();
    for m in &all {
        *seen
            .entry(String::from_utf8(m.payload.to_vec()).unwrap())
            .or_default() += 1;
        let body = std::str::from_utf8(&m.payload).unwrap();
        if body == "first" {
            continue;
        }
        let i: usize = body[1..].parse().unwrap();
        assert_eq!(m.headers.get_str("X-Seq"), Some(i.to_string().as_str()));
        let key = m.headers.get_str(IDEMPOTENCY_KEY_HEADER);
        if i.is_multiple_of(2) {
            assert_eq!(key, Some(format!("k-{i}").as_str()), "m{i}");
        } else {
            assert_eq!(key, None, "m{i}");
        }
    }
    assert!(seen.values().all(|&c| c == 1), "a record stored twice");
    assert_eq!(seen.len(), n + 1);
}

#[tokio::test(flavor = "current_thread")]
async fn a_flood_in_one_task_on_a_current_thread_runtime_lands_once_with_its_headers() {
    flood_and_check(
        "a_flood_in_one_task_on_a_current_thread_runtime_lands_once_with_its_headers",
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_in_one_task_on_a_multi_thread_runtime_lands_once_with_its_headers() {
    flood_and_check(
        "a_flood_in_one_task_on_a_multi_thread_runtime_lands_once_with_its_headers",
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_tasks_on_a_multi_thread_runtime_lands_once_with_its_headers() {
    flood_and_check(
        "a_flood_of_tasks_on_a_multi_thread_runtime_lands_once_with_its_headers",
        true,
    )
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_flood_of_tasks_on_a_current_thread_runtime_lands_once_with_its_headers() {
    flood_and_check(
        "a_flood_of_tasks_on_a_current_thread_runtime_lands_once_with_its_headers",
        true,
    )
    .await;
}

/// Through the backend directly: every send's future is made before any is polled, and half
/// are dropped unpolled. More futures than permits: polled together, the ones that find no
/// permit left take the async path; all land once, the dropped ones not at all (a future does
/// nothing before its first poll), and the ack permits are all given back (a second flood of
/// the same size lands as well).
#[tokio::test(flavor = "current_thread")]
async fn backend_futures_made_before_any_is_polled_all_land_and_give_back_their_permits() {
    let Some(p) =
        platform("backend_futures_made_before_any_is_polled_all_land_and_give_back_their_permits")
            .await
    else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "first")).await.unwrap();
    let n = 8_000;
    for round in 0..2 {
        let futures: Vec<_> = (0..n)
            .map(|i| prod.send(Record::new(t.clone(), format!("r{round}-{i}"))))
            .collect();
        // Made but not yet polled: drop half of them. Nothing of theirs is published, and no
        // permit is kept.
        let (keep, dropped): (Vec<_>, Vec<_>) = futures
            .into_iter()
            .enumerate()
            .partition(|(i, _)| i % 2 == 0);
        drop(dropped);
        for (i, d) in futures::future::join_all(keep.into_iter().map(|(_, f)| f))
            .await
            .into_iter()
            .enumerate()
        {
            d.unwrap_or_else(|e| panic!("round {round} send {}: {e}", 2 * i));
        }
    }
    // With every permit given back, a flood of 5 000 (the whole limit) still goes through.
    let sends = (0..5_000).map(|i| prod.send(Record::new(t.clone(), format!("last-{i}"))));
    for d in futures::future::join_all(sends).await {
        d.unwrap();
    }
    // "first", the kept half of both rounds and the last flood; none of the dropped ones.
    assert_eq!(stored(&p, &t).await, 1 + n as u64 + 5_000);
}

/// A topic whose stream is deleted (by another connection) after the producer cached it:
/// `NotFound`, and once the topic is created again a send lands.
#[tokio::test]
async fn a_send_to_a_deleted_stream_is_not_found_and_works_again_after_recreating() {
    let Some(other) =
        platform("a_send_to_a_deleted_stream_is_not_found_and_works_again_after_recreating").await
    else {
        return;
    };
    let p = platform_with("auto_create=false").await;
    let t = topic(&other, "js-paths", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "a")).await.unwrap();
    other.admin().await.unwrap().delete_topic(&t).await.unwrap();
    // Known to the producer: the direct path, and the server has no stream for the subject.
    let e = prod
        .send(Record::new(t.clone(), "b").idempotency_key("b"))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    // Forgotten after that: looked up again, and still missing.
    let e = prod.send(Record::new(t.clone(), "c")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    other
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(t.clone(), 1))
        .await
        .unwrap();
    let d = prod
        .send(Record::new(t.clone(), "d").idempotency_key("b"))
        .await
        .unwrap();
    assert!(!d.duplicate, "a new stream has not seen Msg-Id b");
    // Known again: the direct path.
    prod.send(Record::new(t.clone(), "e")).await.unwrap();
    assert_eq!(stored(&other, &t).await, 2);
}

/// A record past the server's max_payload fails with `Config` before anything is published,
/// on a known topic (the direct path) and on an unknown one.
#[tokio::test]
async fn an_oversized_record_is_refused_before_it_is_published() {
    let Some(p) = platform("an_oversized_record_is_refused_before_it_is_published").await else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let limit = p.max_record_bytes();
    let big = vec![b'x'; limit + 1];
    let e = prod
        .send(Record::new(t.clone(), big.clone()))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    prod.send(Record::new(t.clone(), "known")).await.unwrap();
    let e = prod
        .send(Record::new(t.clone(), big).idempotency_key("big"))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    // Exactly at the limit (headers included: the record has none but the Msg-Id onceflow
    // adds, which the limit leaves room for).
    prod.send(Record::new(t.clone(), vec![b'y'; limit]))
        .await
        .unwrap();
    assert_eq!(stored(&p, &t).await, 2);
}

/// A connection closed (drained) under a producer that knows its topic: sends fail, none
/// hangs, and the shared server is untouched (another connection still publishes).
#[tokio::test]
async fn a_send_on_a_closed_connection_fails() {
    let Some(p) = platform("a_send_on_a_closed_connection_fails").await else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "a")).await.unwrap();
    let client = p.nats_client();
    client.drain().await.unwrap();
    // Drained once the connection refuses a plain publish.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while client
        .publish("onceflow.drain-probe", "x".into())
        .await
        .is_ok()
    {
        assert!(tokio::time::Instant::now() < deadline, "never closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for i in 0..3 {
        let r = prod
            .send(Record::new(t.clone(), format!("after-{i}")))
            .await;
        assert!(r.is_err(), "send {i} on a drained connection: {r:?}");
    }
    let other = platform("a_send_on_a_closed_connection_fails")
        .await
        .unwrap();
    let prod2 = other.producer(ProducerConfig::default()).await.unwrap();
    prod2.send(Record::new(t.clone(), "b")).await.unwrap();
    assert_eq!(stored(&other, &t).await, 2);
}

/// A record within `max_record_bytes` whose many headers make its message larger than the
/// server's max_payload on the wire (each header's `: ` and line end, and its name again in
/// `onceflow-headers`): refused before it is published, on the direct path as on the first
/// send's; the connection stays usable.
#[tokio::test]
async fn a_record_whose_headers_overflow_max_payload_on_the_wire_is_refused() {
    let Some(p) =
        platform("a_record_whose_headers_overflow_max_payload_on_the_wire_is_refused").await
    else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let big = || {
        let mut r = Record::new(t.clone(), vec![b'x'; p.max_record_bytes() - 400]);
        for i in 0..200 {
            r = r.header(((b'a' + (i % 26) as u8) as char).to_string(), "v");
        }
        assert!(r.size_bytes() <= p.max_record_bytes());
        r
    };
    let e = prod.send(big()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    prod.send(Record::new(t.clone(), "ok")).await.unwrap();
    let e = prod.send(big()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    prod.send(Record::new(t.clone(), "ok")).await.unwrap();
    assert_eq!(stored(&p, &t).await, 2);
}

/// Acks that time out (a 1 ms publish timeout under a flood) are retried with the same
/// `Nats-Msg-Id`, from either path: whatever each send's result, no record is stored twice,
/// every acknowledged one is stored, and a retry that finds its own earlier attempt stored is
/// not flagged a duplicate (the ids are generated).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn timed_out_acks_are_retried_and_nothing_is_stored_twice() {
    let Some(p) = platform("timed_out_acks_are_retried_and_nothing_is_stored_twice").await else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let client = Client::new(p.clone());
    let producer = client
        .producer(
            ProducerConfig::default()
                .option("publish_timeout_ms", "1")
                .option("publish_retries", "20"),
        )
        .await
        .unwrap();
    producer
        .send(Record::new(t.clone(), "first"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let n = 8_000;
    let sends = (0..n).map(|i| producer.send(Record::new(t.clone(), format!("m{i}"))));
    let results = futures::future::join_all(sends).await;
    let mut acked = HashSet::new();
    let mut timed_out = 0;
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(d) => {
                assert!(
                    !d.duplicate,
                    "m{i}: its own earlier attempt, not a duplicate"
                );
                acked.insert(format!("m{i}"));
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Timeout, "m{i}: {e}");
                timed_out += 1;
            }
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "timed_out_acks: {} acknowledged, {timed_out} timed out",
        acked.len()
    );
    let total = stored(&p, &t).await as usize;
    let c = reader(&t).await;
    let all = take(c.as_ref(), total).await;
    c.close().await.unwrap();
    let mut seen = HashSet::new();
    for m in &all {
        let body = String::from_utf8(m.payload.to_vec()).unwrap();
        assert!(seen.insert(body.clone()), "{body} stored twice");
    }
    for a in &acked {
        assert!(seen.contains(a), "{a} acknowledged but not stored");
    }
}

/// A producer that is not idempotent sends records without headers as plain `PUB`s (no
/// header block at all), from either path; a flood of them lands once each, read back without
/// headers, and the few with a key keep it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_without_msg_ids_lands_once_without_headers() {
    let Some(p) = platform("a_flood_without_msg_ids_lands_once_without_headers").await else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let client = Client::new(p.clone());
    let producer = client
        .producer(ProducerConfig {
            idempotent: Some(false),
            ..ProducerConfig::default()
        })
        .await
        .unwrap();
    producer
        .send(Record::new(t.clone(), "first"))
        .await
        .unwrap();
    let n: usize = 12_000;
    let sends = (0..n).map(|i| {
        let r = Record::new(t.clone(), format!("m{i}"));
        if i.is_multiple_of(100) {
            r.key(format!("k{i}"))
        } else {
            r
        }
    });
    for d in futures::future::join_all(sends.map(|r| producer.send(r))).await {
        assert!(!d.unwrap().duplicate);
    }
    assert_eq!(stored(&p, &t).await, n as u64 + 1);
    let c = reader(&t).await;
    let all = take(c.as_ref(), n + 1).await;
    c.close().await.unwrap();
    let mut seen = HashSet::new();
    for m in &all {
        let body = String::from_utf8(m.payload.to_vec()).unwrap();
        assert!(m.headers.is_empty(), "{body}: {:?}", m.headers);
        if body != "first" {
            let i: usize = body[1..].parse().unwrap();
            let want = i.is_multiple_of(100).then(|| format!("k{i}"));
            assert_eq!(
                m.key.as_deref(),
                want.as_deref().map(str::as_bytes),
                "{body}"
            );
        }
        assert!(seen.insert(body.clone()), "{body} stored twice");
    }
}

/// A send's future made on a thread outside the runtime (the producer's `send` called there),
/// then awaited on the runtime: the record lands, as any future made outside and awaited
/// inside does. (`send` used to hand the publish over at once, which starts a tokio timer:
/// it panicked without a runtime.)
#[tokio::test]
async fn a_send_made_outside_the_runtime_and_awaited_inside_lands() {
    let Some(p) = platform("a_send_made_outside_the_runtime_and_awaited_inside_lands").await else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    // Known to the producer: its next send takes the direct path.
    prod.send(Record::new(t.clone(), "first")).await.unwrap();
    let future = std::thread::scope(|s| {
        s.spawn(|| prod.send(Record::new(t.clone(), "made outside")))
            .join()
            .expect("making a send's future outside the runtime")
    });
    let d = future.await.unwrap();
    assert!(!d.duplicate);
    assert_eq!(stored(&p, &t).await, 2);
}

/// A send's future does nothing before it is polled: one dropped unpolled publishes nothing
/// (futures are lazy; the publish is handed over on the first poll, not when `send` is called).
#[tokio::test]
async fn a_send_dropped_before_its_first_poll_publishes_nothing() {
    let Some(p) = platform("a_send_dropped_before_its_first_poll_publishes_nothing").await else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "first")).await.unwrap();
    for i in 0..100 {
        drop(prod.send(Record::new(t.clone(), format!("never {i}"))));
    }
    prod.send(Record::new(t.clone(), "last")).await.unwrap();
    assert_eq!(stored(&p, &t).await, 2);
}

/// A send's boxed future, on the direct path, stays within glibc's per-thread cache of small
/// chunks (requests up to 1032 bytes): with async-nats' ~850-byte `send_publish` future inside
/// it, it was ~1.5 KB and every send paid a slow `malloc` and `free` (see `JetStreamProducer::send_routed`).
#[tokio::test]
async fn a_send_future_is_small() {
    let Some(p) = platform("a_send_future_is_small").await else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "first")).await.unwrap();
    for r in [
        Record::new(t.clone(), "plain"),
        Record::new(t.clone(), "keyed").idempotency_key("k-1"),
    ] {
        let f = prod.send(r);
        let size = std::mem::size_of_val(&*f);
        assert!(size <= 1032, "a send's future is {size} bytes");
        f.await.unwrap();
    }
}

/// Without a tracer provider (none is installed in this binary) a send adds no trace context
/// of its own: a record carrying a `traceparent` keeps exactly that one on the wire, a record
/// sent in a caller's context carries the caller's, and one with neither carries none.
#[tokio::test]
async fn without_a_tracer_provider_the_wire_carries_only_the_callers_or_records_traceparent() {
    use opentelemetry::context::FutureExt as _;
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    };
    let Some(p) = platform(
        "without_a_tracer_provider_the_wire_carries_only_the_callers_or_records_traceparent",
    )
    .await
    else {
        return;
    };
    let t = topic(&p, "js-paths", 1).await;
    let producer = Client::new(p.clone())
        .producer(ProducerConfig::default())
        .await
        .unwrap();
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let caller = SpanContext::new(
        TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
        SpanId::from_hex("00f067aa0ba902b7").unwrap(),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    let caller_cx = opentelemetry::Context::new().with_remote_span_context(caller);
    let mut sent = Vec::new();
    // Twice each: the first send of the producer looks the topic up (the async path).
    for _ in 0..2 {
        let own = producer
            .send(Record::new(t.clone(), "own").header("traceparent", tp))
            .await
            .unwrap();
        let in_caller = producer
            .send(Record::new(t.clone(), "caller").idempotency_key(name("k")))
            .with_context(caller_cx.clone())
            .await
            .unwrap();
        let none = producer.send(Record::new(t.clone(), "none")).await.unwrap();
        sent.push((own, Some(tp.to_string())));
        sent.push((
            in_caller,
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string()),
        ));
        sent.push((none, None));
    }
    let js = async_nats::jetstream::new(p.nats_client());
    let stream = js.get_stream(&t).await.unwrap();
    for (d, want) in sent {
        let raw = stream
            .get_raw_message(d.position.as_sequence().unwrap())
            .await
            .unwrap();
        let got: Vec<String> = raw
            .headers
            .get_all("traceparent")
            .map(|v| v.as_str().to_string())
            .collect();
        assert_eq!(got, want.into_iter().collect::<Vec<_>>(), "{d:?}");
    }
}
