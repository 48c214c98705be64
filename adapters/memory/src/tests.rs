//! Tests of the tricky parts: LSO visibility, fencing, cooperative revoke-before-assign, session
//! timeouts, timestamps, faults.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use onceflow_core::{
    ConsumerBackend, ConsumerConfig, ErrorKind, Isolation, Message, PlatformBackend, Position,
    ProducerConfig, RebalanceListener, Record, StartFrom, TopicPartition, TopicSpec,
};
use parking_lot::Mutex;

use crate::{MemoryOptions, MemoryPlatform};

const SHORT: Duration = Duration::from_millis(30);

fn platform() -> Arc<MemoryPlatform> {
    MemoryPlatform::isolated(MemoryOptions::default())
}

async fn topic(p: &MemoryPlatform, name: &str, partitions: u32) {
    p.admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(name, partitions))
        .await
        .unwrap();
}

fn cfg(group: &str, topic: &str) -> ConsumerConfig {
    ConsumerConfig {
        group: group.into(),
        topics: vec![topic.into()],
        start: StartFrom::committed_or_earliest(),
        ..Default::default()
    }
}

fn txp(id: &str) -> ProducerConfig {
    ProducerConfig {
        transactional_id: Some(id.into()),
        ..Default::default()
    }
}

fn payloads(msgs: &[Message]) -> Vec<String> {
    msgs.iter()
        .map(|m| String::from_utf8(m.payload.to_vec()).unwrap())
        .collect()
}

fn tp(t: &str, p: i32) -> TopicPartition {
    TopicPartition::new(t, p)
}

/// Polls until `n` messages arrived or a second passed.
async fn take(c: &dyn ConsumerBackend, n: usize) -> Vec<Message> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    let mut out = Vec::new();
    while out.len() < n && tokio::time::Instant::now() < deadline {
        out.extend(c.poll(n - out.len(), SHORT).await.unwrap());
    }
    out
}

/// Polls for a short while and returns everything that came.
async fn drain(c: &dyn ConsumerBackend) -> Vec<Message> {
    let mut out = Vec::new();
    for _ in 0..3 {
        out.extend(c.poll(1000, SHORT).await.unwrap());
    }
    out
}

#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<String>>,
    finished: Mutex<HashMap<TopicPartition, Position>>,
}

impl Recorder {
    fn events(&self) -> Vec<String> {
        self.events.lock().clone()
    }
    fn finish(&self, m: &Message) {
        self.finished
            .lock()
            .insert(m.topic_partition(), m.position.clone());
    }
}

fn names(tps: &[TopicPartition]) -> String {
    tps.iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

impl RebalanceListener for Recorder {
    fn on_assigned(&self, partitions: &[TopicPartition]) {
        self.events
            .lock()
            .push(format!("assigned {}", names(partitions)));
    }
    fn on_revoked(&self, partitions: &[TopicPartition]) -> Vec<(TopicPartition, Position)> {
        self.events
            .lock()
            .push(format!("revoked {}", names(partitions)));
        let f = self.finished.lock();
        partitions
            .iter()
            .filter_map(|tp| f.get(tp).map(|p| (tp.clone(), p.clone())))
            .collect()
    }
    fn on_lost(&self, partitions: &[TopicPartition]) {
        self.events
            .lock()
            .push(format!("lost {}", names(partitions)));
    }
}

#[tokio::test]
async fn registry_shares_brokers_by_name() {
    let a = crate::connect("memory://reg-test-a?partitions=2").unwrap();
    let b = crate::connect("memory://reg-test-a").unwrap();
    let c = crate::connect("memory://reg-test-c").unwrap();
    let p = a.producer(ProducerConfig::default()).await.unwrap();
    p.send(Record::new("t", "x")).await.unwrap();
    let d = b.admin().await.unwrap().describe_topic("t").await.unwrap();
    assert_eq!(d.partitions, 2, "auto-created with partitions=2");
    let e = c
        .admin()
        .await
        .unwrap()
        .describe_topic("t")
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(e.message().contains("'t'"));
    assert!(MemoryPlatform::forget("reg-test-a"));
    let fresh = crate::connect("memory://reg-test-a").unwrap();
    assert!(fresh
        .admin()
        .await
        .unwrap()
        .describe_topic("t")
        .await
        .is_err());
}

#[tokio::test]
async fn auto_create_off_and_bad_records_are_clear_errors() {
    let p =
        crate::connect("memory://autocreate-off?auto_create=false&max_record_bytes=100").unwrap();
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let e = prod.send(Record::new("missing", "x")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(e.message().contains("'missing'"), "{e}");
    topic(&p, "t", 2).await;
    let e = prod
        .send(Record::new("t", vec![0u8; 101]))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.message().contains("101") && e.message().contains("100"),
        "{e}"
    );
    let e = prod
        .send(Record::new("t", "x").partition(2))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("partition 2"), "{e}");
    // Nothing accepted was lost, and the producer still works.
    let d = prod
        .send(Record::new("t", "ok").partition(1))
        .await
        .unwrap();
    assert_eq!(d.position, Position::Offset(0));
    // Atomic batch: one bad record, nothing written.
    let e = prod
        .send_atomic(vec![
            Record::new("t", "a").partition(0),
            Record::new("t", "b").partition(7),
        ])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let d = p.admin().await.unwrap().describe_topic("t").await.unwrap();
    assert_eq!(d.watermarks[0].1, Some(Position::Offset(0)));
    let ds = prod
        .send_atomic(vec![
            Record::new("t", "a").partition(0),
            Record::new("t", "b").partition(0),
        ])
        .await
        .unwrap();
    assert_eq!(ds[1].position, Position::Offset(1));
}

#[tokio::test]
async fn keys_partition_like_kafka_and_keyless_round_robin() {
    let p = platform();
    topic(&p, "t", 4).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for k in 0..20 {
        let key = format!("key-{k}");
        let d = prod
            .send(Record::new("t", "v").key(key.clone()))
            .await
            .unwrap();
        assert_eq!(d.partition, crate::partition_for_key(key.as_bytes(), 4));
    }
    let mut seen = [0; 4];
    for _ in 0..8 {
        let d = prod.send(Record::new("t", "v")).await.unwrap();
        seen[d.partition as usize] += 1;
    }
    assert_eq!(seen, [2, 2, 2, 2]);
}

#[tokio::test]
async fn read_committed_stops_at_the_last_stable_offset_and_skips_aborted() {
    let p = platform();
    topic(&p, "t", 1).await;
    let tx_prod = p.producer(txp("tx-a")).await.unwrap();
    let plain = p.producer(ProducerConfig::default()).await.unwrap();
    let rc = p.consumer(cfg("rc", "t")).await.unwrap();
    let ru = p
        .consumer(ConsumerConfig {
            isolation: Isolation::ReadUncommitted,
            ..cfg("ru", "t")
        })
        .await
        .unwrap();

    let mut tx = tx_prod.begin().await.unwrap();
    assert_eq!(
        tx.send(Record::new("t", "a")).await.unwrap().position,
        Position::Offset(0)
    );
    tx.send(Record::new("t", "b")).await.unwrap();
    plain.send(Record::new("t", "c")).await.unwrap();
    // The open transaction's first record is the LSO: even the plain record after it waits.
    assert!(drain(&*rc).await.is_empty());
    assert_eq!(payloads(&take(&*ru, 3).await), ["a", "b", "c"]);
    tx.commit().await.unwrap();
    assert_eq!(payloads(&take(&*rc, 3).await), ["a", "b", "c"]);

    let mut tx = tx_prod.begin().await.unwrap();
    tx.send(Record::new("t", "d")).await.unwrap();
    tx.abort().await.unwrap();
    let mut tx = tx_prod.begin().await.unwrap();
    let e = tx.send(Record::new("t", "e")).await.unwrap();
    tx.commit().await.unwrap();
    // a b c [commit] d [abort] e [commit]
    assert_eq!(e.position, Position::Offset(6));
    let got = drain(&*rc).await;
    assert_eq!(payloads(&got), ["e"]);
    assert_eq!(got[0].position, Position::Offset(6));
    assert_eq!(payloads(&drain(&*ru).await), ["d", "e"]);
    let hw = p.admin().await.unwrap().describe_topic("t").await.unwrap();
    assert_eq!(hw.watermarks[0].1, Some(Position::Offset(8)));
}

#[tokio::test]
async fn dropping_an_open_transaction_aborts_it_and_empty_transactions_commit() {
    let p = platform();
    topic(&p, "t", 1).await;
    let prod = p.producer(txp("tx-drop")).await.unwrap();
    let tx = prod.begin().await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = prod.begin().await.unwrap();
    tx.send(Record::new("t", "gone")).await.unwrap();
    drop(tx);
    let mut tx = prod.begin().await.unwrap();
    tx.send(Record::new("t", "kept")).await.unwrap();
    tx.commit().await.unwrap();
    let rc = p.consumer(cfg("g", "t")).await.unwrap();
    assert_eq!(payloads(&drain(&*rc).await), ["kept"]);

    // A transactional producer writes only inside a transaction; begin needs an id.
    let e = prod.send(Record::new("t", "x")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let plain = p.producer(ProducerConfig::default()).await.unwrap();
    assert_eq!(plain.begin().await.err().unwrap().kind(), ErrorKind::Config);
    let _open = prod.begin().await.unwrap();
    assert_eq!(prod.begin().await.err().unwrap().kind(), ErrorKind::Config);
}

#[tokio::test]
async fn a_new_producer_with_the_same_transactional_id_fences_the_old_one() {
    let p = platform();
    topic(&p, "t", 1).await;
    let old = p.producer(txp("tx-f")).await.unwrap();
    let mut tx = old.begin().await.unwrap();
    tx.send(Record::new("t", "zombie")).await.unwrap();
    let new = p.producer(txp("tx-f")).await.unwrap();
    let e = tx.send(Record::new("t", "zombie2")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced);
    assert_eq!(tx.commit().await.unwrap_err().kind(), ErrorKind::Fenced);
    assert_eq!(old.begin().await.err().unwrap().kind(), ErrorKind::Fenced);
    assert_eq!(
        old.send(Record::new("t", "x")).await.unwrap_err().kind(),
        ErrorKind::Fenced
    );
    let mut tx = new.begin().await.unwrap();
    tx.send(Record::new("t", "fresh")).await.unwrap();
    tx.commit().await.unwrap();
    let rc = p.consumer(cfg("g", "t")).await.unwrap();
    assert_eq!(payloads(&drain(&*rc).await), ["fresh"]);
}

#[tokio::test]
async fn a_crashed_producer_blocks_the_lso_until_fenced() {
    let p = platform();
    topic(&p, "t", 1).await;
    let prod = p.producer(txp("tx-c")).await.unwrap();
    let plain = p.producer(ProducerConfig::default()).await.unwrap();
    let mut tx = prod.begin().await.unwrap();
    tx.send(Record::new("t", "in-flight")).await.unwrap();
    assert!(p.faults().crash_producer("tx-c"));
    assert_eq!(
        tx.send(Record::new("t", "x")).await.unwrap_err().kind(),
        ErrorKind::Closed
    );
    assert_eq!(tx.commit().await.unwrap_err().kind(), ErrorKind::Closed);
    plain.send(Record::new("t", "after")).await.unwrap();
    let rc = p.consumer(cfg("g", "t")).await.unwrap();
    assert!(
        drain(&*rc).await.is_empty(),
        "the open transaction holds the LSO"
    );
    assert_eq!(p.faults().aborted_transactions("tx-c"), 0);
    let restarted = p.producer(txp("tx-c")).await.unwrap();
    assert_eq!(payloads(&drain(&*rc).await), ["after"]);
    // Fencing aborted the crashed one; an abort and a dropped unfinished one count too.
    assert_eq!(p.faults().aborted_transactions("tx-c"), 1);
    restarted.begin().await.unwrap().abort().await.unwrap();
    let mut unfinished = restarted.begin().await.unwrap();
    unfinished.send(Record::new("t", "dropped")).await.unwrap();
    drop(unfinished);
    assert_eq!(p.faults().aborted_transactions("tx-c"), 3);
    assert_eq!(p.faults().aborted_transactions("no-such-id"), 0);
}

#[tokio::test]
async fn cooperative_rebalance_revokes_before_it_assigns() {
    let p = platform();
    topic(&p, "t", 4).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..8 {
        prod.send(Record::new("t", format!("m{i}")).partition(i % 4))
            .await
            .unwrap();
    }
    let a = p.consumer(cfg("g", "t")).await.unwrap();
    let ra = Arc::new(Recorder::default());
    a.set_rebalance_listener(ra.clone());
    let got = take(&*a, 8).await;
    assert_eq!(got.len(), 8);
    assert_eq!(ra.events(), ["assigned t[0],t[1],t[2],t[3]"]);
    for m in &got {
        ra.finish(m);
    }
    let gen_a = a.group_metadata().unwrap().generation;

    let b = p.consumer(cfg("g", "t")).await.unwrap();
    let rb = Arc::new(Recorder::default());
    b.set_rebalance_listener(rb.clone());
    // B can take nothing until A has revoked.
    assert!(b.poll(10, SHORT).await.unwrap().is_empty());
    assert!(b.assignment().is_empty());
    assert!(rb.events().is_empty());
    assert_eq!(a.assignment().len(), 4);

    assert!(a.poll(10, SHORT).await.unwrap().is_empty());
    assert_eq!(ra.events()[1], "revoked t[2],t[3]");
    assert_eq!(a.assignment(), [tp("t", 0), tp("t", 1)]);
    assert!(a.group_metadata().unwrap().generation > gen_a);
    // The positions the listener returned were committed before the move.
    let committed = a.committed(&[tp("t", 2), tp("t", 3)]).await.unwrap();
    assert_eq!(committed[0].1, Some(Position::Offset(2)));

    prod.send(Record::new("t", "new").partition(3))
        .await
        .unwrap();
    let got = take(&*b, 1).await;
    assert_eq!(rb.events(), ["assigned t[2],t[3]"]);
    assert_eq!(payloads(&got), ["new"], "B resumes after what A finished");
    assert_eq!(b.assignment(), [tp("t", 2), tp("t", 3)]);

    // Committing a partition the member does not own is fenced.
    let e = a
        .commit(&[(tp("t", 3), Position::Offset(0))])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced);

    // Leaving moves partitions back without a revocation at B.
    b.close().await.unwrap();
    assert_eq!(
        b.poll(1, SHORT).await.unwrap_err().kind(),
        ErrorKind::Closed
    );
    drain(&*a).await;
    assert_eq!(a.assignment().len(), 4);
    assert_eq!(ra.events().last().unwrap(), "assigned t[2],t[3]");
}

#[tokio::test]
async fn a_member_that_stops_polling_is_removed_after_its_session_timeout() {
    let p = platform();
    topic(&p, "t", 2).await;
    let a = p
        .consumer(ConsumerConfig {
            session_timeout: Some(Duration::from_millis(150)),
            ..cfg("g", "t")
        })
        .await
        .unwrap();
    let ra = Arc::new(Recorder::default());
    a.set_rebalance_listener(ra.clone());
    a.poll(1, SHORT).await.unwrap();
    assert_eq!(a.assignment().len(), 2);
    let old_member = a.group_metadata().unwrap().member_id;

    let b = p.consumer(cfg("g", "t")).await.unwrap();
    let start = std::time::Instant::now();
    while b.assignment().len() < 2 {
        b.poll(10, SHORT).await.unwrap();
        assert!(start.elapsed() < Duration::from_secs(2), "A never expired");
    }
    assert!(start.elapsed() >= Duration::from_millis(100));
    // A's commits are fenced; its next poll reports the loss and rejoins.
    let e = a
        .commit(&[(tp("t", 0), Position::Offset(0))])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced);
    a.poll(1, SHORT).await.unwrap();
    assert_eq!(ra.events()[1], "lost t[0],t[1]");
    assert_ne!(a.group_metadata().unwrap().member_id, old_member);
    // Rejoining rebalances: B gives one partition back at its next poll.
    for _ in 0..5 {
        b.poll(10, SHORT).await.unwrap();
        a.poll(10, SHORT).await.unwrap();
    }
    assert_eq!(a.assignment().len(), 1);
    assert_eq!(b.assignment().len(), 1);
}

#[tokio::test]
async fn transactional_offset_commits_are_fenced_for_zombies() {
    let p = platform();
    topic(&p, "in", 2).await;
    topic(&p, "out", 1).await;
    let a = p.consumer(cfg("g", "in")).await.unwrap();
    a.poll(1, SHORT).await.unwrap();
    let md = a.group_metadata().unwrap();
    let prod = p.producer(txp("pipe")).await.unwrap();

    // B joins: a new generation, but A still owns both until its next poll.
    let b = p.consumer(cfg("g", "in")).await.unwrap();
    b.poll(1, SHORT).await.unwrap();
    let mut tx = prod.begin().await.unwrap();
    tx.send(Record::new("out", "1")).await.unwrap();
    tx.commit_offsets(&md, &[(tp("in", 1), Position::Offset(4))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        a.committed(&[tp("in", 1)]).await.unwrap()[0].1,
        Some(Position::Offset(5))
    );

    // A revokes in[1]; a transaction with the old metadata for in[1] is a zombie.
    let mut tx = prod.begin().await.unwrap();
    tx.send(Record::new("out", "zombie")).await.unwrap();
    tx.commit_offsets(&md, &[(tp("in", 1), Position::Offset(9))])
        .await
        .unwrap();
    a.poll(1, SHORT).await.unwrap();
    assert_eq!(a.assignment(), [tp("in", 0)]);
    let e = tx.commit().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced);
    assert_eq!(
        a.committed(&[tp("in", 1)]).await.unwrap()[0].1,
        Some(Position::Offset(5))
    );
    // in[0] is still A's: the old metadata commits it fine.
    let mut tx = prod.begin().await.unwrap();
    tx.commit_offsets(&md, &[(tp("in", 0), Position::Offset(0))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The zombie's output was aborted.
    let rc = p.consumer(cfg("reader", "out")).await.unwrap();
    assert_eq!(payloads(&drain(&*rc).await), ["1"]);
}

#[tokio::test]
async fn start_positions_and_seek_by_timestamp() {
    let p = platform();
    topic(&p, "t", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for (i, ts) in [1000, 2000, 3000].into_iter().enumerate() {
        let mut r = Record::new("t", format!("m{i}"));
        r.timestamp = Some(ts);
        let d = prod.send(r).await.unwrap();
        assert_eq!(d.timestamp, Some(ts));
    }
    let at = |start: StartFrom, g: &str| {
        let p = p.clone();
        let g = g.to_string();
        async move {
            let c = p
                .consumer(ConsumerConfig {
                    start,
                    ..cfg(&g, "t")
                })
                .await
                .unwrap();
            (payloads(&drain(&*c).await), c)
        }
    };
    assert_eq!(at(StartFrom::Timestamp(1500), "g1").await.0, ["m1", "m2"]);
    assert_eq!(at(StartFrom::Timestamp(2000), "g2").await.0, ["m1", "m2"]);
    assert_eq!(
        at(StartFrom::Position(Position::Offset(2)), "g3").await.0,
        ["m2"]
    );
    let (got, late) = at(StartFrom::Timestamp(9000), "g4").await;
    assert!(got.is_empty());
    let (got, latest) = at(StartFrom::Latest, "g5").await;
    assert!(got.is_empty());
    prod.send(Record::new("t", "m3")).await.unwrap();
    assert_eq!(
        payloads(&drain(&*late).await),
        ["m3"],
        "starts at the end, not 0"
    );
    assert_eq!(payloads(&drain(&*latest).await), ["m3"]);
    let got = drain(&*latest).await;
    assert!(got.is_empty());
    latest
        .seek(&tp("t", 0), &StartFrom::Timestamp(2500))
        .await
        .unwrap();
    assert_eq!(payloads(&drain(&*latest).await), ["m2", "m3"]);
    let e = latest
        .seek(&tp("t", 0), &StartFrom::Position(Position::Offset(99)))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let e = latest
        .seek(&tp("t", 1), &StartFrom::Earliest)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
}

#[tokio::test]
async fn nack_rewinds_and_counts_deliveries() {
    let p = platform();
    topic(&p, "t", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..4 {
        prod.send(Record::new("t", format!("m{i}"))).await.unwrap();
    }
    let c = p.consumer(cfg("g", "t")).await.unwrap();
    let got = take(&*c, 4).await;
    assert!(got.iter().all(|m| m.delivery_count == 1));
    c.nack(&got[1], Duration::ZERO).await.unwrap();
    let again = take(&*c, 3).await;
    assert_eq!(payloads(&again), ["m1", "m2", "m3"]);
    assert!(again.iter().all(|m| m.delivery_count == 2));
    // A delay holds the partition back.
    c.nack(&again[2], Duration::from_millis(150)).await.unwrap();
    let t0 = std::time::Instant::now();
    let third = c.poll(10, Duration::from_secs(2)).await.unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(140));
    assert_eq!(third[0].delivery_count, 3);
    // A new member of the same group reading from the start sees redeliveries.
    c.close().await.unwrap();
    let c2 = p.consumer(cfg("g", "t")).await.unwrap();
    assert!(take(&*c2, 4).await.iter().all(|m| m.delivery_count >= 2));
}

#[tokio::test]
async fn pause_resume_lag_and_headers() {
    let p = platform();
    topic(&p, "t", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let c = p.consumer(cfg("g", "t")).await.unwrap();
    c.poll(1, SHORT).await.unwrap();
    c.pause(&[tp("t", 0)]).await.unwrap();
    let mut r = Record::new("t", "h").key("k");
    r.headers
        .insert("bin", Bytes::from_static(&[0, 255]))
        .insert_null("null")
        .insert("empty", "")
        .insert("bin", "2");
    prod.send(r.clone()).await.unwrap();
    assert!(drain(&*c).await.is_empty());
    c.resume(&[tp("t", 0)]).await.unwrap();
    let m = take(&*c, 1).await.pop().unwrap();
    assert_eq!(m.headers, r.headers);
    assert_eq!(m.key.as_deref(), Some(&b"k"[..]));
    for _ in 0..4 {
        prod.send(Record::new("t", "x")).await.unwrap();
    }
    assert_eq!(c.lag().await.unwrap()[0].messages, 5);
    c.commit(&[(tp("t", 0), Position::Offset(1))])
        .await
        .unwrap();
    let lag = c.lag().await.unwrap();
    assert_eq!(lag[0].messages, 3);
    assert_eq!(lag[0].committed, Some(Position::Offset(2)));
    assert_eq!(lag[0].high_watermark, Some(Position::Offset(5)));
    let outside = p.admin().await.unwrap().group_lag("g", "t").await.unwrap();
    assert_eq!(outside, lag);
    assert_eq!(
        c.pause(&[tp("t", 9)]).await.unwrap_err().kind(),
        ErrorKind::Config
    );
}

#[tokio::test]
async fn injected_redeliveries_follow_the_original() {
    let p = platform();
    topic(&p, "t", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..9 {
        prod.send(Record::new("t", format!("m{i}"))).await.unwrap();
    }
    p.faults().redeliver_every(3);
    let c = p.consumer(cfg("g", "t")).await.unwrap();
    let got = take(&*c, 12).await;
    assert_eq!(
        payloads(&got),
        ["m0", "m1", "m2", "m2", "m3", "m4", "m5", "m5", "m6", "m7", "m8", "m8"]
    );
    assert_eq!(got[3].delivery_count, 2);
    assert_eq!(p.faults().redelivered(), 3);
    p.faults().stop_redelivery();

    // Probabilistic and seeded: the same seed gives the same pattern.
    let pattern = |seed| {
        let p = p.clone();
        async move {
            p.faults().redeliver_with_probability(0.3, seed);
            let c = p
                .consumer(cfg(&format!("seeded-{seed}-{}", rand_suffix()), "t"))
                .await
                .unwrap();
            let got = payloads(&take(&*c, 9).await);
            let mut all = got;
            all.extend(payloads(&drain(&*c).await));
            p.faults().stop_redelivery();
            all
        }
    };
    let a = pattern(7).await;
    let b = pattern(7).await;
    assert_eq!(a, b);
    assert!(a.len() > 9);
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

#[tokio::test]
async fn dropped_commits_and_crashes_around_commit() {
    let p = platform();
    topic(&p, "t", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..3 {
        prod.send(Record::new("t", format!("m{i}"))).await.unwrap();
    }
    let c = p.consumer(cfg("g", "t")).await.unwrap();
    let got = take(&*c, 3).await;
    let tp0 = tp("t", 0);

    p.faults().drop_commits(1);
    c.commit(&[(tp0.clone(), got[0].position.clone())])
        .await
        .unwrap();
    assert_eq!(
        c.committed(std::slice::from_ref(&tp0)).await.unwrap()[0].1,
        None
    );
    assert_eq!(p.faults().dropped_commits(), 1);
    c.commit(&[(tp0.clone(), got[0].position.clone())])
        .await
        .unwrap();
    assert_eq!(
        c.committed(std::slice::from_ref(&tp0)).await.unwrap()[0].1,
        Some(Position::Offset(1))
    );

    // Crash before commit: not applied, the consumer is dead and left the group.
    let other = p.consumer(cfg("g", "t")).await.unwrap();
    let ro = Arc::new(Recorder::default());
    other.set_rebalance_listener(ro.clone());
    p.faults().crash_before_commit("g");
    let e = c
        .commit(&[(tp0.clone(), got[1].position.clone())])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Closed);
    assert_eq!(
        c.poll(1, SHORT).await.unwrap_err().kind(),
        ErrorKind::Closed
    );
    assert_eq!(c.close().await.unwrap_err().kind(), ErrorKind::Closed);
    assert_eq!(
        other.committed(std::slice::from_ref(&tp0)).await.unwrap()[0].1,
        Some(Position::Offset(1))
    );
    let resumed = take(&*other, 2).await;
    assert_eq!(payloads(&resumed), ["m1", "m2"]);
    assert_eq!(ro.events(), ["assigned t[0]"]);

    // Crash after commit: applied, then dead.
    p.faults().crash_after_commit("g");
    let e = other
        .commit(&[(tp0.clone(), resumed[1].position.clone())])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Closed);
    let third = p.consumer(cfg("g", "t")).await.unwrap();
    assert_eq!(
        third.committed(std::slice::from_ref(&tp0)).await.unwrap()[0].1,
        Some(Position::Offset(3))
    );
    assert!(drain(&*third).await.is_empty());
}

#[tokio::test]
async fn admin_create_is_idempotent_and_delete_moves_on() {
    let p = platform();
    let admin = p.admin().await.unwrap();
    let spec = TopicSpec::new("t", 3);
    admin.create_topic(&spec).await.unwrap();
    admin.create_topic(&spec).await.unwrap();
    let e = admin
        .create_topic(&TopicSpec::new("t", 4))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("'t'"));
    let mut compacted = TopicSpec::new("c", 1);
    compacted.compacted = true;
    assert_eq!(
        admin.create_topic(&compacted).await.unwrap_err().kind(),
        ErrorKind::Unsupported
    );
    assert_eq!(
        admin
            .create_topic(&TopicSpec::new("z", 0))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::Config
    );
    // Too many partitions is refused by name and value, before any log is allocated.
    let e = admin
        .create_topic(&TopicSpec::new("huge", u32::MAX))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("'huge'") && e.message().contains("4294967295"));
    assert!(e.message().contains("100000"), "{e}");
    let d = admin.describe_topic("t").await.unwrap();
    assert_eq!(d.partitions, 3);
    assert_eq!(d.watermarks.len(), 3);

    // A subscriber of a topic that does not exist yet is assigned once it is created; deleting
    // it takes the partitions away.
    let c = p.consumer(cfg("g", "later")).await.unwrap();
    let rc = Arc::new(Recorder::default());
    c.set_rebalance_listener(rc.clone());
    assert!(drain(&*c).await.is_empty());
    admin
        .create_topic(&TopicSpec::new("later", 2))
        .await
        .unwrap();
    drain(&*c).await;
    assert_eq!(c.assignment().len(), 2);
    admin.delete_topic("later").await.unwrap();
    drain(&*c).await;
    assert!(c.assignment().is_empty());
    assert_eq!(rc.events().last().unwrap(), "lost later[0],later[1]");
    assert_eq!(
        admin.delete_topic("later").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
}

#[tokio::test]
async fn poll_waits_for_data_without_spinning() {
    let p = platform();
    topic(&p, "t", 1).await;
    let c = p.consumer(cfg("g", "t")).await.unwrap();
    c.poll(1, SHORT).await.unwrap();
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let waiter = tokio::spawn({
        let c = c.clone();
        async move {
            let t0 = std::time::Instant::now();
            let got = c.poll(10, Duration::from_secs(5)).await.unwrap();
            (got.len(), t0.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    prod.send(Record::new("t", "x")).await.unwrap();
    let (n, waited) = waiter.await.unwrap();
    assert_eq!(n, 1);
    assert!(waited < Duration::from_secs(1), "woken by the append");
}

/// A worker whose message's key another worker holds (a 30 s lease) notices the holder's
/// completion within half a second, not after a third of the lease (#31). Virtual time: the
/// clock is paused and jumps to each timer, so the bound is exact and the test takes no time.
#[tokio::test(start_paused = true)]
async fn a_key_held_by_another_worker_is_seen_completed_within_half_a_second() {
    use onceflow_core::dedup::{fingerprint, ClaimOutcome, ClaimRequest, DedupStore, MemoryStore};
    use onceflow_core::{handler_fn, Client, DedupStoreExt, EngineConfig, IdempotentConsumer};

    let p = platform();
    topic(&p, "held", 1).await;
    let client = Client::new(p.clone());
    let producer = client.producer(ProducerConfig::default()).await.unwrap();
    producer
        .send(Record::new("held", "v").idempotency_key("k"))
        .await
        .unwrap();
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new(Duration::from_secs(3600), 1000));
    let lease = Duration::from_secs(30);
    let request = ClaimRequest {
        key: "g/k".into(),
        owner: "the-other-worker".into(),
        lease,
        fingerprint: Some(fingerprint(b"v")),
    };
    let ClaimOutcome::Claimed { token } = store.claim_one(request).await.unwrap() else {
        panic!("the other worker's claim");
    };
    let ran = Arc::new(Mutex::new(0));
    let handler = {
        let ran = ran.clone();
        handler_fn(move |_m| {
            let ran = ran.clone();
            async move {
                *ran.lock() += 1;
                Ok(None)
            }
        })
    };
    let engine = IdempotentConsumer::with_config(
        client.consumer(cfg("g", "held")).await.unwrap(),
        Some(store.clone()),
        Arc::new(handler),
        EngineConfig {
            lease,
            ..EngineConfig::default()
        },
        None,
    )
    .unwrap();
    let completed = tokio::spawn({
        let store = store.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            assert!(store.complete_one("g/k", token, None).await.unwrap());
            tokio::time::Instant::now()
        }
    });
    while engine.metrics().snapshot().duplicates_skipped == 0 {
        engine.step().await.unwrap();
    }
    let noticed = tokio::time::Instant::now();
    let completed = completed.await.unwrap();
    assert_eq!(
        *ran.lock(),
        0,
        "the holder's completion is a duplicate here"
    );
    assert!(
        noticed.duration_since(completed) <= Duration::from_millis(500),
        "noticed {:?} after the completion",
        noticed.duration_since(completed)
    );
}

/// The memory backend reads no producer or consumer options: one given is refused, by name
/// (never its value), instead of being ignored as if applied.
#[tokio::test]
async fn producer_and_consumer_options_are_refused_by_name() {
    let p = platform();
    topic(&p, "opts", 1).await;
    let producer = ProducerConfig::default()
        .option("linger.ms", "5")
        .option("sasl.password", "hunter2");
    let e = p.producer(producer).await.err().expect("refused");
    assert_eq!(e.kind(), ErrorKind::Config);
    let text = e.to_string();
    assert!(
        text.contains("unknown memory:// producer options 'linger.ms', 'sasl.password'"),
        "{text}"
    );
    assert!(
        text.contains("partitions, auto_create, max_record_bytes"),
        "{text}"
    );
    assert!(!text.contains("hunter2"), "{text}");
    let e = p
        .consumer(cfg("g", "opts").option("ackWaitMs", "100"))
        .await
        .err()
        .expect("refused");
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.to_string()
            .contains("unknown memory:// consumer option 'ackWaitMs'"),
        "{e}"
    );
    // No options: as before.
    p.producer(ProducerConfig::default()).await.unwrap();
    p.consumer(cfg("g", "opts")).await.unwrap();
}
