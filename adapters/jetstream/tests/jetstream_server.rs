//! JetStream-specific behaviour on a real nats-server (the platform-neutral cases are in the
//! conformance suite, `tests/tests/backend_jetstream.rs`). Runs when `ONCEFLOW_NATS_URL` is set
//! (`set -a; eval "$(tests/brokers/up.sh nats)"; set +a`); without it each test prints that it
//! skipped and why.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use std::sync::{Arc, Mutex};

use onceflow_core::dedup::MemoryStore;
use onceflow_core::{
    handler_fn, Client, ConsumerConfig, EngineConfig, ErrorKind, IdempotentConsumer,
    PlatformBackend, ProducerConfig, Record, StartFrom, TopicSpec,
};
use onceflow_jetstream::JetStreamPlatform;

mod common;
use common::{name, platform, reconnected, take, topic, PrivateServer, URL_VAR};

#[tokio::test]
async fn same_msg_id_is_a_duplicate_with_the_original_position() {
    let Some(p) = platform("same_msg_id_is_a_duplicate_with_the_original_position").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let r = Record::new(t.clone(), "once").idempotency_key("order-1");
    let first = prod.send(r.clone()).await.unwrap();
    let again = prod.send(r).await.unwrap();
    assert!(!first.duplicate);
    assert!(again.duplicate, "the server saw Nats-Msg-Id order-1 before");
    assert_eq!(again.position, first.position);
    let d = p.admin().await.unwrap().describe_topic(&t).await.unwrap();
    assert_eq!(d.options.get("messages").map(String::as_str), Some("1"));
}

/// More sends in flight than async-nats allows acks pending (5 000 by default): the first
/// ones are handed to the connection at once, the rest wait for a permit (the send's async
/// path). Every record is stored exactly once, each with its own Msg-Id and stream sequence.
#[tokio::test]
async fn sends_past_the_in_flight_ack_limit_all_land_once() {
    let Some(p) = platform("sends_past_the_in_flight_ack_limit_all_land_once").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    // The first send looks the topic up; the others find it known and take the direct path.
    prod.send(Record::new(t.clone(), "first")).await.unwrap();
    let n = 12_000;
    let sends = (0..n).map(|i| prod.send(Record::new(t.clone(), format!("m{i}"))));
    let deliveries: Vec<_> = futures::future::join_all(sends).await;
    let mut sequences = std::collections::HashSet::new();
    for d in deliveries {
        let d = d.expect("every send is acknowledged");
        assert!(!d.duplicate);
        assert!(sequences.insert(d.position), "two sends got one position");
    }
    assert_eq!(sequences.len(), n);
    let d = p.admin().await.unwrap().describe_topic(&t).await.unwrap();
    assert_eq!(
        d.options.get("messages").map(String::as_str),
        Some((n + 1).to_string().as_str())
    );
}

#[tokio::test]
async fn header_names_keep_their_case_on_the_wire() {
    let Some(p) = platform("header_names_keep_their_case_on_the_wire").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let d = prod
        .send(
            Record::new(t.clone(), "h")
                .header("X-Trace-ID", "abc")
                .idempotency_key("h-1"),
        )
        .await
        .unwrap();
    // As another client sees it.
    let js = async_nats::jetstream::new(p.nats_client());
    let stream = js.get_stream(&t).await.unwrap();
    let raw = stream
        .get_raw_message(d.position.as_sequence().unwrap())
        .await
        .unwrap();
    assert_eq!(
        raw.headers.get("X-Trace-ID").map(|v| v.as_str()),
        Some("abc")
    );
    assert!(raw.headers.get("x-trace-id").is_none());
    assert_eq!(
        raw.headers.get("Nats-Msg-Id").map(|v| v.as_str()),
        Some("h-1")
    );
    // As onceflow reads it.
    let c = p
        .consumer(ConsumerConfig::new(name("g"), [t.clone()]))
        .await
        .unwrap();
    let m = &take(c.as_ref(), 1).await[0];
    assert_eq!(m.headers.get_str("X-Trace-ID"), Some("abc"));
    assert_eq!(m.headers.get("x-trace-id"), None);
    c.close().await.unwrap();
}

#[tokio::test]
async fn atomic_batch_needs_a_stream_that_allows_it() {
    let Some(p) = platform("atomic_batch_needs_a_stream_that_allows_it").await else {
        return;
    };
    let t = name("js-noatomic");
    let mut spec = TopicSpec::new(t.clone(), 1);
    spec.options.insert("allow_atomic".into(), "false".into());
    p.admin().await.unwrap().create_topic(&spec).await.unwrap();
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let e = prod
        .send_atomic(vec![
            Record::new(t.clone(), "a"),
            Record::new(t.clone(), "b"),
        ])
        .await
        .expect_err("atomic publish is disabled on this stream");
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    let d = p.admin().await.unwrap().describe_topic(&t).await.unwrap();
    assert_eq!(d.options.get("messages").map(String::as_str), Some("0"));
}

#[tokio::test]
async fn a_reconnecting_consumer_resumes_its_durable() {
    let Some(p) = platform("a_reconnecting_consumer_resumes_its_durable").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let group = name("g");
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..6 {
        prod.send(Record::new(t.clone(), format!("m{i}")))
            .await
            .unwrap();
    }
    let c = p
        .consumer(ConsumerConfig::new(group.clone(), [t.clone()]))
        .await
        .unwrap();
    let got = take(c.as_ref(), 6).await;
    c.commit(&[(got[2].topic_partition(), got[2].position.clone())])
        .await
        .unwrap();
    c.close().await.unwrap();
    let js = async_nats::jetstream::new(p.nats_client());
    let stream = js.get_stream(&t).await.unwrap();
    let durable = onceflow_jetstream::durable(&group, 0);
    let created = stream.consumer_info(&durable).await.unwrap().created;

    // A new connection, as after a restart.
    let p2 = onceflow_jetstream::connect(&std::env::var(URL_VAR).unwrap())
        .await
        .unwrap();
    let c2 = p2
        .consumer(
            ConsumerConfig::new(group.clone(), [t.clone()])
                .start(StartFrom::committed_or_earliest()),
        )
        .await
        .unwrap();
    let rest = take(c2.as_ref(), 3).await;
    let payloads: Vec<_> = rest.iter().map(|m| m.payload.clone()).collect();
    assert_eq!(payloads, [Bytes::from("m3"), "m4".into(), "m5".into()]);
    assert_eq!(
        stream.consumer_info(&durable).await.unwrap().created,
        created,
        "the durable was resumed, not created again"
    );
    c2.close().await.unwrap();
}

#[tokio::test]
async fn in_progress_holds_and_nack_redelivers() {
    let Some(p) = platform("in_progress_holds_and_nack_redelivers").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "slow")).await.unwrap();
    let c = p
        .consumer(ConsumerConfig::new(name("g"), [t.clone()]).option("ack_wait_ms", "1000"))
        .await
        .unwrap();
    let m = take(c.as_ref(), 1).await.remove(0);
    assert_eq!(m.delivery_count, 1);
    // Three ack_waits with +WPI every 300 ms: never redelivered.
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < until {
        c.in_progress(&m).await.unwrap();
        assert!(c
            .poll(10, Duration::from_millis(300))
            .await
            .unwrap()
            .is_empty());
    }
    c.nack(&m, Duration::from_millis(100)).await.unwrap();
    let again = take(c.as_ref(), 1).await.remove(0);
    assert_eq!(again.position, m.position);
    assert_eq!(again.delivery_count, 2);
    c.commit(&[(again.topic_partition(), again.position.clone())])
        .await
        .unwrap();
    let lag = c.lag().await.unwrap();
    assert_eq!(lag[0].messages, 0, "{lag:?}");
    c.close().await.unwrap();
}

/// A member that died holding messages (delivered, never acked) leaves them ack-pending on the
/// durable; the server gives them to the next owner only after `ack_wait`, behind newer
/// messages the next owner already took. The next owner must return them, not take them for
/// its own committed redeliveries (the crash test lost an output that way).
#[tokio::test]
async fn a_dead_owners_unacked_messages_reach_the_next_owner() {
    let Some(p) = platform("a_dead_owners_unacked_messages_reach_the_next_owner").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let group = name("g");
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    dead_owner_holds(&p, &t, &group, 5).await;
    for i in 5..8 {
        prod.send(Record::new(t.clone(), format!("m{i}")))
            .await
            .unwrap();
    }
    // The next owner resumes the durable at once: m5..m7 first, m0..m4 after ack_wait.
    let c = p
        .consumer(
            ConsumerConfig::new(group.clone(), [t.clone()])
                .start(StartFrom::committed_or_earliest())
                .option("ack_wait_ms", "1500"),
        )
        .await
        .unwrap();
    let first = take(c.as_ref(), 3).await;
    c.commit(&[(first[2].topic_partition(), first[2].position.clone())])
        .await
        .unwrap();
    let mut payloads: Vec<Bytes> = first.iter().map(|m| m.payload.clone()).collect();
    let rest = take(c.as_ref(), 5).await;
    payloads.extend(rest.iter().map(|m| m.payload.clone()));
    payloads.sort();
    let want: Vec<Bytes> = (0..8).map(|i| Bytes::from(format!("m{i}"))).collect();
    assert_eq!(payloads, want, "every message, once");
    let last = rest
        .iter()
        .max_by_key(|m| m.position.as_sequence())
        .unwrap();
    c.commit(&[(last.topic_partition(), last.position.clone())])
        .await
        .unwrap();
    let lag = c.lag().await.unwrap();
    assert_eq!(lag[0].messages, 0, "{lag:?}");
    c.close().await.unwrap();
}

/// Publishes `m0`..`m{n-1}` (each with its payload as idempotency key) to the one-partition
/// topic `t`, and makes a dead owner of `group`'s durable: a raw consumer that pulls them with
/// a 1.5 s `ack_wait` and never acks, so the server redelivers them to the next owner after
/// that, behind newer messages.
async fn dead_owner_holds(p: &JetStreamPlatform, t: &str, group: &str, n: usize) {
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..n {
        let m = format!("m{i}");
        prod.send(Record::new(t, m.clone()).idempotency_key(m))
            .await
            .unwrap();
    }
    let js = async_nats::jetstream::new(p.nats_client());
    let stream = js.get_stream(t).await.unwrap();
    let dead = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some(onceflow_jetstream::durable(group, 0)),
            filter_subject: onceflow_jetstream::subject(t, 1, 0),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_millis(1500),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut batch = dead.fetch().max_messages(n).messages().await.unwrap();
    let mut held = 0;
    while let Some(m) = batch.next().await {
        m.unwrap();
        held += 1;
    }
    assert_eq!(held, n, "the dead owner holds m0..m{}", n - 1);
}

/// Runs an idempotent consumer of `group` on the one-partition topic `t` (consumer options
/// `options`, a memory dedup store when `store`) until it has handled `n` messages, then
/// 4 s longer (every commit, and redeliveries of anything left unacked, happen in that time);
/// `slow(payload)` runs inside the handler. Returns the payloads handled, sorted.
async fn handle_all(
    p: &Arc<JetStreamPlatform>,
    group: &str,
    t: &str,
    options: &[(&str, &str)],
    store: bool,
    n: usize,
    slow: impl Fn(String) -> futures::future::BoxFuture<'static, ()> + Send + Sync + 'static,
) -> Vec<String> {
    let mut config = ConsumerConfig::new(group, [t]).start(StartFrom::committed_or_earliest());
    for (k, v) in options {
        config = config.option(*k, *v);
    }
    let consumer = Client::new(p.clone()).consumer(config).await.unwrap();
    let handled = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = handled.clone();
    let slow = Arc::new(slow);
    let handler = handler_fn(move |m: onceflow_core::Message| {
        let (seen, slow) = (seen.clone(), slow.clone());
        async move {
            let text = String::from_utf8_lossy(&m.payload).into_owned();
            seen.lock().unwrap().push(text.clone());
            slow(text).await;
            Ok(None)
        }
    });
    let store: Option<Arc<dyn onceflow_core::DedupStore>> =
        store.then(|| Arc::new(MemoryStore::new(Duration::from_secs(600), 1000)) as _);
    let engine = IdempotentConsumer::with_config(
        consumer,
        store,
        Arc::new(handler),
        EngineConfig::default(),
        None,
    )
    .unwrap();
    let watched = handled.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    engine
        .run_until(async move {
            while watched.lock().unwrap().len() < n && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tokio::time::sleep(Duration::from_secs(4)).await;
        })
        .await
        .unwrap();
    let mut got = handled.lock().unwrap().clone();
    got.sort();
    got
}

/// The server's view of `group`'s durable on the one-partition topic `t`, and the stream's
/// last sequence.
async fn durable_info(
    p: &JetStreamPlatform,
    t: &str,
    group: &str,
) -> (async_nats::jetstream::consumer::Info, u64) {
    let js = async_nats::jetstream::new(p.nats_client());
    let mut stream = js.get_stream(t).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut durable: async_nats::jetstream::consumer::PullConsumer = stream
        .get_consumer(&onceflow_jetstream::durable(group, 0))
        .await
        .unwrap();
    (durable.info().await.unwrap().clone(), last)
}

/// The idempotent consumer taking over from a dead owner: the dead owner's unacked messages
/// come back after `ack_wait`, behind newer messages fetched while the handler ran. Every
/// message is handled once and the partition's lag reaches 0: the commit names the highest
/// position handled, not the batch's last (before, the commit of such a batch acked only the
/// redeliveries, the newer messages stayed unacked and were redelivered every `ack_wait`
/// without end; the crash test hung on it once).
#[tokio::test]
async fn redeliveries_behind_newer_messages_leave_no_lag() {
    let Some(p) = platform("redeliveries_behind_newer_messages_leave_no_lag").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let group = name("g");
    dead_owner_holds(&p, &t, &group, 5).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "m5").idempotency_key("m5"))
        .await
        .unwrap();
    // While m5 runs, m6 and m7 arrive and the dead owner's m0..m4 time out: the next fetch
    // holds m6, m7, then m0..m4.
    let topic_out = t.clone();
    let got = handle_all(
        &p,
        &group,
        &t,
        &[("ack_wait_ms", "1500")],
        true,
        8,
        move |m| {
            let (t, prod) = (topic_out.clone(), prod.clone());
            Box::pin(async move {
                if m == "m5" {
                    for i in 6..8 {
                        let k = format!("m{i}");
                        prod.send(Record::new(t.clone(), k.clone()).idempotency_key(k))
                            .await
                            .unwrap();
                    }
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                }
            })
        },
    )
    .await;
    let want: Vec<String> = (0..8).map(|i| format!("m{i}")).collect();
    assert_eq!(got, want, "every message handled once");
    // Nothing left for the group: the durable's ack floor is the stream's last message.
    let (info, last) = durable_info(&p, &t, &group).await;
    assert_eq!(
        (info.ack_floor.stream_sequence, info.num_ack_pending),
        (last, 0),
        "every message acked: {info:?}"
    );
}

/// A handler that runs longer than `ack_wait` burns no deliveries (each counts toward
/// `max_deliver`, after which the server gives the message up or dead-letters it): the adapter
/// sends `+WPI` for every message delivered and not acknowledged, whether polled (the slow
/// one, those behind it in its batch) or still waiting to be polled (fetched while the slow
/// one runs). Once with every message in the first batch and no dedup store, once with m1 and
/// m2 sent while m0 runs and a store. Before, nothing signalled the messages behind the slow
/// one nor the prefetched ones, and the slow one only every third of a claim's lease (30 s)
/// and only with a store: they were redelivered every second.
#[tokio::test]
async fn a_handler_longer_than_ack_wait_burns_no_deliveries() {
    let Some(p) = platform("a_handler_longer_than_ack_wait_burns_no_deliveries").await else {
        return;
    };
    for (store, prefetched) in [(false, false), (true, true)] {
        let t = topic(&p, "js-topic", 1).await;
        let group = name("g");
        let prod = p.producer(ProducerConfig::default()).await.unwrap();
        let send = move |prod: Arc<dyn onceflow_core::ProducerBackend>, t: String, i: usize| async move {
            let k = format!("m{i}");
            prod.send(Record::new(t, k.clone()).idempotency_key(k))
                .await
                .unwrap();
        };
        send(prod.clone(), t.clone(), 0).await;
        if !prefetched {
            send(prod.clone(), t.clone(), 1).await;
            send(prod.clone(), t.clone(), 2).await;
        }
        let options = [("ack_wait_ms", "1000"), ("max_deliver", "3")];
        let topic_in = t.clone();
        let got = handle_all(&p, &group, &t, &options, store, 3, move |m| {
            let (prod, t) = (prod.clone(), topic_in.clone());
            Box::pin(async move {
                if m == "m0" {
                    if prefetched {
                        send(prod.clone(), t.clone(), 1).await;
                        send(prod, t, 2).await;
                    }
                    tokio::time::sleep(Duration::from_millis(3500)).await;
                }
            })
        })
        .await;
        let case = format!("store={store} prefetched={prefetched}");
        assert_eq!(got, ["m0", "m1", "m2"], "{case}: each once");
        let (info, last) = durable_info(&p, &t, &group).await;
        assert_eq!(
            (
                info.delivered.consumer_sequence,
                info.num_redelivered,
                info.ack_floor.stream_sequence
            ),
            (3, 0, last),
            "{case}: 3 deliveries, none again, all acked: {info:?}"
        );
    }
}

/// JetStream redelivers a message whose `ack_wait` expired even to the member holding it;
/// onceflow's owner sees it once until it nacks (the engine suite's `read_all` polled for
/// longer than `ack_wait` without committing and read every message twice).
#[tokio::test]
async fn a_held_message_is_not_polled_again_after_ack_wait() {
    let Some(p) = platform("a_held_message_is_not_polled_again_after_ack_wait").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..3 {
        prod.send(Record::new(t.clone(), format!("m{i}")))
            .await
            .unwrap();
    }
    let group = name("g");
    let c = p
        .consumer(ConsumerConfig::new(group.clone(), [t.clone()]).option("ack_wait_ms", "500"))
        .await
        .unwrap();
    let got = take(c.as_ref(), 3).await;
    // Several ack_waits: the server redelivers, the owner does not see them again.
    let until = tokio::time::Instant::now() + Duration::from_millis(2500);
    let mut again = Vec::new();
    while tokio::time::Instant::now() < until {
        again.extend(c.poll(10, Duration::from_millis(200)).await.unwrap());
    }
    assert!(again.is_empty(), "polled again: {again:?}");
    // The commit (acking the newest delivery) holds; a nacked message still comes back.
    c.nack(&got[2], Duration::ZERO).await.unwrap();
    c.commit(&[(got[1].topic_partition(), got[1].position.clone())])
        .await
        .unwrap();
    let back = take(c.as_ref(), 1).await.remove(0);
    assert_eq!(back.position, got[2].position);
    c.commit(&[(back.topic_partition(), back.position.clone())])
        .await
        .unwrap();
    let lag = c.lag().await.unwrap();
    assert_eq!(lag[0].messages, 0, "{lag:?}");
    let until = tokio::time::Instant::now() + Duration::from_millis(1200);
    while tokio::time::Instant::now() < until {
        let more = c.poll(10, Duration::from_millis(200)).await.unwrap();
        assert!(more.is_empty(), "committed messages came back: {more:?}");
    }
    c.close().await.unwrap();
}

#[tokio::test]
async fn partitions_are_subjects() {
    let Some(p) = platform("partitions_are_subjects").await else {
        return;
    };
    let t = topic(&p, "js-topic", 3).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let d = prod
        .send(Record::new(t.clone(), "x").partition(2))
        .await
        .unwrap();
    assert_eq!(d.partition, 2);
    let js = async_nats::jetstream::new(p.nats_client());
    let raw = js
        .get_stream(&t)
        .await
        .unwrap()
        .get_raw_message(d.position.as_sequence().unwrap())
        .await
        .unwrap();
    assert_eq!(raw.subject.as_str(), format!("{t}.2"));
    let e = prod
        .send(Record::new(t.clone(), "x").partition(3))
        .await
        .expect_err("partition 3 of 3");
    assert_eq!(e.kind(), ErrorKind::Config);
}

#[tokio::test]
async fn a_dedup_store_window_shorter_than_the_duplicate_window_warns_once() {
    let Some(p) =
        platform("a_dedup_store_window_shorter_than_the_duplicate_window_warns_once").await
    else {
        return;
    };
    let t = name("js-topic");
    let mut spec = TopicSpec::new(t.clone(), 1);
    spec.options
        .insert("duplicate_window_ms".into(), "60000".into());
    p.admin().await.unwrap().create_topic(&spec).await.unwrap();
    assert_eq!(
        p.duplicate_window(&t).await.unwrap(),
        Duration::from_secs(60)
    );
    let first = p
        .check_dedup_window(&t, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(first.shorter && first.warned, "{first:?}");
    let second = p
        .check_dedup_window(&t, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(second.shorter && !second.warned, "warned twice: {second:?}");
    let long = p
        .check_dedup_window(&t, Duration::from_secs(600))
        .await
        .unwrap();
    assert!(!long.shorter && !long.warned, "{long:?}");
    let missing = p
        .check_dedup_window(&name("js-missing"), Duration::from_secs(1))
        .await
        .expect_err("no such stream");
    assert_eq!(missing.kind(), ErrorKind::NotFound);
}

/// The server gives a message up after `max_deliver` deliveries and says so in a
/// `MAX_DELIVERIES` advisory; the owner republishes it to the dead-letter topic with the reason
/// in headers and terminates it, so the group moves past it.
#[tokio::test]
async fn max_deliver_sends_the_message_to_the_dead_letter_topic() {
    let Some(p) = platform("max_deliver_sends_the_message_to_the_dead_letter_topic").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let dlq = topic(&p, "js-topic", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..3 {
        prod.send(
            Record::new(t.clone(), format!("m{i}"))
                .key(format!("k{i}"))
                .header("App-Header", format!("h{i}")),
        )
        .await
        .unwrap();
    }
    let c = p
        .consumer(
            ConsumerConfig::new(name("g"), [t.clone()])
                .option("max_deliver", "2")
                .option("dead_letter", dlq.clone()),
        )
        .await
        .unwrap();
    let got = take(c.as_ref(), 3).await;
    c.nack(&got[1], Duration::ZERO).await.unwrap();
    let again = take(c.as_ref(), 1).await.remove(0);
    assert_eq!(again.position, got[1].position);
    assert_eq!(again.delivery_count, 2);
    // The second nack exhausts max_deliver=2: the server does not deliver it a third time.
    c.nack(&again, Duration::ZERO).await.unwrap();
    c.commit(&[(got[2].topic_partition(), got[2].position.clone())])
        .await
        .unwrap();

    let reader = p
        .consumer(ConsumerConfig::new(name("g"), [dlq.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let dead = take(reader.as_ref(), 1).await.remove(0);
    assert_eq!(dead.payload, Bytes::from("m1"));
    assert_eq!(dead.key.as_deref(), Some(&b"k1"[..]));
    assert_eq!(dead.headers.get_str("App-Header"), Some("h1"));
    assert_eq!(
        dead.headers.get_str("onceflow-error-kind"),
        Some("ONCEFLOW_MAX_DELIVER")
    );
    assert_eq!(dead.headers.get_str("onceflow-attempts"), Some("2"));
    assert_eq!(
        dead.headers.get_str("onceflow-source-topic"),
        Some(t.as_str())
    );
    assert_eq!(
        dead.headers.get_str("onceflow-source-position"),
        Some(got[1].position.to_string().as_str())
    );
    assert!(dead
        .headers
        .get_str("onceflow-error")
        .is_some_and(|e| e.contains("max_deliver=2")));

    // Terminated: nothing pending, nothing comes back, and it was written once.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let lag = c.lag().await.unwrap();
        if lag[0].messages == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{lag:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(c
        .poll(10, Duration::from_millis(500))
        .await
        .unwrap()
        .is_empty());
    let d = p.admin().await.unwrap().describe_topic(&dlq).await.unwrap();
    assert_eq!(d.options["messages"], "1");
    c.close().await.unwrap();
    reader.close().await.unwrap();
}

#[tokio::test]
async fn dead_letter_needs_max_deliver() {
    let Some(p) = platform("dead_letter_needs_max_deliver").await else {
        return;
    };
    let t = topic(&p, "js-topic", 1).await;
    let e = p
        .consumer(ConsumerConfig::new(name("g"), [t]).option("dead_letter", "dlq"))
        .await
        .err()
        .expect("max_deliver is unlimited by default");
    assert_eq!(e.kind(), ErrorKind::Config);
}

/// A consumer of `group` on `t` with these options and start.
async fn open(
    p: &JetStreamPlatform,
    t: &str,
    group: &str,
    start: StartFrom,
    options: &[(&str, &str)],
) -> Arc<dyn onceflow_core::ConsumerBackend> {
    let mut cfg = ConsumerConfig::new(group.to_string(), [t.to_string()]).start(start);
    for (k, v) in options {
        cfg.options.insert(k.to_string(), v.to_string());
    }
    p.consumer(cfg).await.unwrap()
}

/// Reopening a durable with other settings updates it (consumer update, nats-server ≥ 2.10);
/// an explicit start on an existing durable resumes it (before, the durable was deleted and
/// created again: the group's progress was lost and every message came back) unless
/// `reset=true` asks to start over.
#[tokio::test]
async fn reopening_a_durable_updates_it_and_an_explicit_start_resumes_it() {
    let Some(p) = platform("reopening_a_durable_updates_it_and_an_explicit_start_resumes_it").await
    else {
        return;
    };
    let t = topic(&p, "js-reopen", 1).await;
    let group = name("g");
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..3 {
        prod.send(Record::new(t.clone(), format!("m{i}")))
            .await
            .unwrap();
    }
    let c = open(&p, &t, &group, StartFrom::Earliest, &[]).await;
    let got = take(c.as_ref(), 3).await;
    c.commit(&[(got[2].topic_partition(), got[2].position.clone())])
        .await
        .unwrap();
    c.close().await.unwrap();
    let (before, _) = durable_info(&p, &t, &group).await;
    assert_eq!(before.config.ack_wait, Duration::from_secs(30));

    let c = open(
        &p,
        &t,
        &group,
        StartFrom::Earliest,
        &[
            ("ack_wait_ms", "5000"),
            ("max_ack_pending", "50"),
            ("max_deliver", "7"),
        ],
    )
    .await;
    let (after, _) = durable_info(&p, &t, &group).await;
    assert_eq!(after.created, before.created, "resumed, not created again");
    assert_eq!(after.config.ack_wait, Duration::from_secs(5));
    assert_eq!(after.config.max_ack_pending, 50);
    assert_eq!(after.config.max_deliver, 7);
    assert_eq!(after.ack_floor.stream_sequence, 3, "progress kept");
    let again = c.poll(100, Duration::from_secs(2)).await.unwrap();
    assert!(
        again.is_empty(),
        "start=earliest re-read {} messages",
        again.len()
    );
    c.close().await.unwrap();
    let c = open(
        &p,
        &t,
        &group,
        StartFrom::committed_or_earliest(),
        &[("max_deliver", "7"), ("backoff_ms", "1000,2000")],
    )
    .await;
    let (after, _) = durable_info(&p, &t, &group).await;
    assert_eq!(
        after.config.backoff,
        [Duration::from_secs(1), Duration::from_secs(2)]
    );
    c.close().await.unwrap();

    // A member (or a CLI run) that gives none of these settings keeps the durable's: before,
    // its defaults silently replaced them (max_deliver 7 became -1, the backoff went).
    let c = open(&p, &t, &group, StartFrom::committed_or_earliest(), &[]).await;
    let (kept, _) = durable_info(&p, &t, &group).await;
    assert_eq!(kept.config.max_deliver, 7);
    assert_eq!(kept.config.max_ack_pending, 50);
    assert_eq!(
        kept.config.backoff,
        [Duration::from_secs(1), Duration::from_secs(2)]
    );
    assert_eq!(kept.created, before.created);
    c.close().await.unwrap();

    let c = open(&p, &t, &group, StartFrom::Earliest, &[("reset", "true")]).await;
    let all = take(c.as_ref(), 3).await;
    assert_eq!(all[0].payload, Bytes::from("m0"));
    let (reset, _) = durable_info(&p, &t, &group).await;
    assert_ne!(reset.created, before.created, "reset=true created it again");
    assert_eq!(reset.config.ack_wait, Duration::from_secs(30));
    c.close().await.unwrap();
}

/// `idle_heartbeat_ms` reaches the pull requests and a consumer with it reads as before; a
/// heartbeat longer than half the request's expiry is a `Config` error naming both.
#[tokio::test]
async fn idle_heartbeat_is_configurable() {
    let Some(p) = platform("idle_heartbeat_is_configurable").await else {
        return;
    };
    let t = topic(&p, "js-hb", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "m0")).await.unwrap();
    let group = name("g");
    let c = open(
        &p,
        &t,
        &group,
        StartFrom::Earliest,
        &[("idle_heartbeat_ms", "100"), ("pull_expires_ms", "2000")],
    )
    .await;
    assert_eq!(take(c.as_ref(), 1).await[0].payload, Bytes::from("m0"));
    c.close().await.unwrap();
    let mut cfg = ConsumerConfig::new(name("g"), [t.clone()]);
    cfg.options
        .insert("idle_heartbeat_ms".into(), "2000".into());
    let e = p.consumer(cfg).await.err().expect("refused");
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.message().contains("idle_heartbeat_ms=2000")
            && e.message().contains("pull_expires_ms=500"),
        "{e}"
    );
}

/// The durability report: storage, replicas and the server's sync setting as far as a
/// client can read it (an ordinary user cannot: `Unknown`, and durable-on-ack is then
/// unknown for a file stream); `require_durable` warns once per topic.
#[tokio::test]
async fn the_durability_report_says_what_an_ack_promises() {
    let Some(p) = platform("the_durability_report_says_what_an_ack_promises").await else {
        return;
    };
    let url = std::env::var(URL_VAR).unwrap();
    let file = topic(&p, "js-file", 1).await;
    let r = p.durability(&file).await.unwrap();
    assert_eq!((r.storage, r.replicas), ("file", 1));
    assert_eq!(r.sync, onceflow_jetstream::ServerSync::Unknown);
    assert_eq!(r.durable_on_ack, None);
    assert!(!r.warned, "no warning unless require_durable");
    assert!(
        r.risk().unwrap().contains("sync_interval"),
        "{:?}",
        r.risk()
    );
    let d = p
        .admin()
        .await
        .unwrap()
        .describe_topic(&file)
        .await
        .unwrap();
    assert_eq!(
        d.options.get("durable_on_ack").map(String::as_str),
        Some("unknown")
    );
    assert_eq!(d.options.get("sync").map(String::as_str), Some("unknown"));

    let mem = name("js-mem");
    let mut spec = TopicSpec::new(mem.clone(), 1);
    spec.options.insert("storage".into(), "memory".into());
    p.admin().await.unwrap().create_topic(&spec).await.unwrap();
    let strict = onceflow_jetstream::connect(&format!("{url}?require_durable=true"))
        .await
        .unwrap();
    let r = strict.durability(&mem).await.unwrap();
    assert_eq!((r.storage, r.durable_on_ack), ("memory", Some(false)));
    assert!(r.warned, "{r:?}");
    assert!(r.risk().unwrap().contains("memory"));
    assert!(
        !strict.durability(&mem).await.unwrap().warned,
        "warned twice"
    );
    let e = strict.durability(&name("js-missing")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
}

/// After a server restart, until JetStream answers again, a publish and an API request get
/// "no responders": retriable `Connect` errors (before, `NotFound`, not retriable, and
/// describe_topic said the topic did not exist). Once JetStream is back the same producer
/// sends again. The restart is simulated by a server without JetStream on the same port (a
/// server still recovering its streams answers the same way), then one with it.
#[tokio::test]
async fn errors_while_jetstream_recovers_are_retriable() {
    let test = "errors_while_jetstream_recovers_are_retriable";
    if platform(test).await.is_none() {
        return;
    }
    let Some(mut server) = PrivateServer::new(test) else {
        return;
    };
    server.start(true).await;
    let p = onceflow_jetstream::connect(&format!(
        "{}?publish_timeout_ms=1000&publish_retries=0&request_timeout_ms=1000",
        server.url()
    ))
    .await
    .unwrap();
    let t = topic(&p, "js-restart", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "a")).await.unwrap();

    server.kill();
    server.start(false).await;
    reconnected(&p).await;
    let e = prod.send(Record::new(t.clone(), "b")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Connect, "{e}");
    assert!(e.is_retriable(), "{e}");
    let e = p
        .admin()
        .await
        .unwrap()
        .describe_topic(&t)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Connect, "{e}");
    assert!(e.is_retriable(), "{e}");

    server.kill();
    server.start(true).await;
    reconnected(&p).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match prod.send(Record::new(t.clone(), "c")).await {
            Ok(_) => break,
            Err(e) => {
                assert!(e.is_retriable(), "not retriable while recovering: {e}");
                assert!(tokio::time::Instant::now() < deadline, "still failing: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let d = p.admin().await.unwrap().describe_topic(&t).await.unwrap();
    assert_eq!(d.options.get("messages").map(String::as_str), Some("2"));
}

/// A member that stalls past its session timeout loses its partition to another member; its
/// commit afterwards is `Fenced` and acks nothing (before, it acked the messages the new
/// owner was handling and returned Ok, and its keepalive kept them from reaching the new
/// owner at all). The new owner gets the message after `ack_wait` and commits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_losing_the_partition_is_fenced() {
    let Some(p) = platform("a_commit_after_losing_the_partition_is_fenced").await else {
        return;
    };
    let t = topic(&p, "js-fenced", 1).await;
    let group = name("g");
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "m0")).await.unwrap();
    let member = |id: &str| {
        let mut cfg = ConsumerConfig::new(group.clone(), [t.clone()]);
        cfg.session_timeout = Some(Duration::from_secs(1));
        cfg.client_id = Some(id.to_string());
        cfg.options.insert("ack_wait_ms".into(), "2000".into());
        cfg
    };
    let a = p.consumer(member("a")).await.unwrap();
    let got = take(a.as_ref(), 1).await;
    let b = p.consumer(member("b")).await.unwrap();
    // `a` no longer polls: `b` takes the partition after a's session timeout and gets the
    // message after ack_wait.
    let again = take(b.as_ref(), 1).await;
    assert_eq!(again[0].position, got[0].position);
    let e = a
        .commit(&[(got[0].topic_partition(), got[0].position.clone())])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    assert!(e.message().contains("member 'b'"), "{e}");
    let (info, _) = durable_info(&p, &t, &group).await;
    assert_eq!(
        info.ack_floor.stream_sequence, 0,
        "the fenced commit acked nothing"
    );
    b.commit(&[(again[0].topic_partition(), again[0].position.clone())])
        .await
        .unwrap();
    let (info, _) = durable_info(&p, &t, &group).await;
    assert_eq!(info.ack_floor.stream_sequence, 1);
    a.close().await.unwrap();
    b.close().await.unwrap();
}

/// A commit whose ack comes after the message's ack deadline (here the runtime is blocked
/// past `ack_wait`, so no in-progress signal went out) is a retriable `Timeout` naming the
/// sequence, though the server took the ack (before: a plain Ok); a retry is a no-op.
#[tokio::test] // one thread: the blocking sleep stalls the keepalive too
async fn an_ack_after_its_deadline_is_reported() {
    let Some(p) = platform("an_ack_after_its_deadline_is_reported").await else {
        return;
    };
    let t = topic(&p, "js-late", 1).await;
    let group = name("g");
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "m0")).await.unwrap();
    let c = open(
        &p,
        &t,
        &group,
        StartFrom::Earliest,
        &[("ack_wait_ms", "1000")],
    )
    .await;
    let got = take(c.as_ref(), 1).await;
    std::thread::sleep(Duration::from_millis(2500));
    let at = [(got[0].topic_partition(), got[0].position.clone())];
    let e = c.commit(&at).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.is_retriable(), "{e}");
    assert!(e.message().contains("seq:1"), "{e}");
    let (info, _) = durable_info(&p, &t, &group).await;
    assert_eq!(info.ack_floor.stream_sequence, 1, "the late ack counted");
    c.commit(&at).await.unwrap();
    c.close().await.unwrap();
}

/// A durable the server will not update (here a stream whose consumer limits cap
/// `max_ack_pending` at 100) is a `Config` error naming the setting, the durable's value and
/// the requested one; the durable keeps its settings and nothing is recreated.
#[tokio::test]
async fn a_durable_the_server_will_not_update_is_a_config_error() {
    let Some(p) = platform("a_durable_the_server_will_not_update_is_a_config_error").await else {
        return;
    };
    let t = name("js-limits");
    let js = async_nats::jetstream::new(p.nats_client());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: t.clone(),
        subjects: vec![t.clone()],
        consumer_limits: Some(async_nats::jetstream::stream::ConsumerLimits {
            inactive_threshold: Duration::ZERO,
            max_ack_pending: 100,
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    let group = name("g");
    let c = open(
        &p,
        &t,
        &group,
        StartFrom::Earliest,
        &[("max_ack_pending", "50")],
    )
    .await;
    c.close().await.unwrap();
    let mut cfg = ConsumerConfig::new(group.clone(), [t.clone()]);
    cfg.options.insert("max_ack_pending".into(), "500".into());
    let e = p.consumer(cfg).await.err().expect("refused");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message()
            .contains("max_ack_pending: the durable has 50, requested 500"),
        "{e}"
    );
    assert!(e.message().contains("reset=true"), "{e}");
    let (info, _) = durable_info(&p, &t, &group).await;
    assert_eq!(info.config.max_ack_pending, 50);
}

/// A consumer keeps reading across a server restart (SIGKILL, then the same store): its pull
/// request in flight died with the server and is given up 5 s after its expiry without a
/// heartbeat (async-nats' batch timeout; measured 5.4 s), after two heartbeats without a word
/// from the server (at least 500 ms) with `idle_heartbeat_ms` (measured 0.45 s; 5.4 s before
/// the heartbeat was used at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_reads_on_after_a_server_restart() {
    let test = "a_consumer_reads_on_after_a_server_restart";
    if platform(test).await.is_none() {
        return;
    }
    for options in [vec![], vec![("idle_heartbeat_ms", "100")]] {
        let Some(mut server) = PrivateServer::new(test) else {
            return;
        };
        server.start(true).await;
        let p = onceflow_jetstream::connect(&format!("{}?request_timeout_ms=1000", server.url()))
            .await
            .unwrap();
        let t = topic(&p, "js-restart", 1).await;
        let prod = p.producer(ProducerConfig::default()).await.unwrap();
        prod.send(Record::new(t.clone(), "a")).await.unwrap();
        let c = open(&p, &t, &name("g"), StartFrom::Earliest, &options).await;
        assert_eq!(take(c.as_ref(), 1).await[0].payload, Bytes::from("a"));
        server.kill();
        server.start(true).await;
        reconnected(&p).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while let Err(e) = prod.send(Record::new(t.clone(), "b")).await {
            assert!(e.is_retriable(), "{e}");
            assert!(tokio::time::Instant::now() < deadline, "{e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let started = tokio::time::Instant::now();
        let mut got = Vec::new();
        while got.is_empty() && started.elapsed() < Duration::from_secs(15) {
            got = c
                .poll(10, Duration::from_millis(200))
                .await
                .unwrap_or_default();
        }
        assert_eq!(
            got.first().map(|m| m.payload.clone()),
            Some(Bytes::from("b")),
            "{options:?}: nothing read within 15 s of the restart"
        );
        let took = started.elapsed();
        eprintln!(
            "{options:?}: read again {} ms after the restart",
            took.as_millis()
        );
        if !options.is_empty() {
            assert!(
                took < Duration::from_secs(3),
                "with idle_heartbeat_ms=100 the dead request is given up 500 ms after the \
                 server's last heartbeat: read again after {took:?}"
            );
        }
        c.close().await.unwrap();
    }
}

/// An ack nobody answers because the durable is gone (deleted here, as a reset by another
/// member would) is `Fenced`; before, async-nats' double ack took the server's 503 (no
/// responders) for a confirmation and the commit returned Ok.
#[tokio::test]
async fn an_ack_to_a_deleted_durable_is_fenced() {
    let Some(p) = platform("an_ack_to_a_deleted_durable_is_fenced").await else {
        return;
    };
    let t = topic(&p, "js-gone", 1).await;
    let group = name("g");
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "m0")).await.unwrap();
    let c = open(&p, &t, &group, StartFrom::Earliest, &[]).await;
    let got = take(c.as_ref(), 1).await;
    let js = async_nats::jetstream::new(p.nats_client());
    js.get_stream(&t)
        .await
        .unwrap()
        .delete_consumer(&onceflow_jetstream::durable(&group, 0))
        .await
        .unwrap();
    let e = c
        .commit(&[(got[0].topic_partition(), got[0].position.clone())])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    assert!(e.message().contains("durable is gone"), "{e}");
    c.close().await.unwrap();
}
