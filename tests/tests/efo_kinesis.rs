//! Enhanced fan-out (`fan_out=efo`: RegisterStreamConsumer + SubscribeToShard) on a real
//! Kinesis-compatible server (`tests/brokers/up.sh kinesis`, kinesis-local):
//!
//! - records written before and while the consumer is subscribed arrive, in order per
//!   partition key; the registered stream consumer is `ACTIVE` and the member holds the
//!   subscriptions (a second SubscribeToShard of that consumer and shard is refused with
//!   `ResourceInUseException`, so the records did come through SubscribeToShard);
//! - lag is reported per shard (`MillisBehindLatest` from the events, records not yet handled);
//! - a checkpoint and a restart (a new member of the group) resume after the checkpoint: no
//!   record lost, no committed record delivered again;
//! - a shard split while a group of two EFO members consumes keeps per-key order, parent before
//!   child, and the parent is checkpointed `SHARD_END`.
//! - a dropped connection (a loopback relay cut mid-subscription) is followed by a new
//!   subscription after the last continuation: nothing lost, nothing delivered twice;
//! - on a server without enhanced fan-out (kinesalite, `ONCEFLOW_KINESALITE_URL`, not started by
//!   the broker scripts) `fan_out=efo` is `Unsupported` and `fan_out=auto` polls.
//!
//! Runs when `ONCEFLOW_KINESIS_URL` is set; without it each test says it skipped, and with
//! `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) that is a failure.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use onceflow_conformance::harness::broker_url;
use onceflow_core::{
    ConsumerBackend, ConsumerConfig, Message, PlatformBackend, Position, ProducerBackend,
    ProducerConfig, Record, StartFrom, TopicPartition, TopicSpec,
};
use onceflow_kinesis::KinesisPlatform;
use onceflow_kinesis::SHARD_END;

const KEYS: usize = 6;

async fn platform(test: &str) -> Option<Arc<KinesisPlatform>> {
    let url = match broker_url("ONCEFLOW_KINESIS_URL", "kinesis") {
        Ok(u) => u,
        Err(reason) => {
            eprintln!("{test}: SKIPPED: {reason}");
            return None;
        }
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    Some(
        onceflow_kinesis::connect(&format!("{url}{sep}fan_out=efo&lease_ms=2000&idle_ms=100"))
            .await
            .unwrap(),
    )
}

async fn create_stream(platform: &KinesisPlatform, prefix: &str, shards: u32) -> String {
    let stream = format!("{prefix}-{:016x}", rand::random::<u64>());
    platform
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(stream.clone(), shards))
        .await
        .unwrap();
    stream
}

/// Writes records `key-k/n` for n in `range`, every key, keyed by `key-k`.
async fn send(producer: &Arc<dyn ProducerBackend>, stream: &str, range: std::ops::Range<usize>) {
    let mut records = Vec::new();
    for n in range {
        for k in 0..KEYS {
            records.push(
                Record::new(stream.to_string(), format!("key-{k}/{n}")).key(format!("key-{k}")),
            );
        }
    }
    for r in producer.send_batch(records).await {
        r.expect("send");
    }
}

fn parse(m: &Message) -> (String, usize) {
    let text = String::from_utf8(m.payload.to_vec()).unwrap();
    let (k, n) = text.split_once('/').unwrap();
    (k.to_string(), n.parse().unwrap())
}

/// Polls until `want` messages arrived (or 60 s passed), then 1.5 s more to catch extras.
async fn poll_n(consumer: &Arc<dyn ConsumerBackend>, want: usize) -> Vec<Message> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while got.len() < want && tokio::time::Instant::now() < deadline {
        got.extend(
            consumer
                .poll(500, Duration::from_millis(200))
                .await
                .unwrap(),
        );
    }
    let extra_until = tokio::time::Instant::now() + Duration::from_millis(1500);
    while tokio::time::Instant::now() < extra_until {
        got.extend(
            consumer
                .poll(500, Duration::from_millis(200))
                .await
                .unwrap(),
        );
    }
    got
}

/// The last position per partition of `msgs`, for commit.
fn last_positions(msgs: &[Message]) -> Vec<(TopicPartition, Position)> {
    let mut last: BTreeMap<TopicPartition, Position> = BTreeMap::new();
    for m in msgs {
        last.insert(m.topic_partition(), m.position.clone());
    }
    last.into_iter().collect()
}

/// Asserts `msgs` hold exactly `range` for every key, in order per key.
fn assert_exactly(msgs: &[Message], range: std::ops::Range<usize>, what: &str) {
    let mut per_key: HashMap<String, Vec<usize>> = HashMap::new();
    for m in msgs {
        let (k, n) = parse(m);
        per_key.entry(k).or_default().push(n);
    }
    assert_eq!(per_key.len(), KEYS, "{what}: keys {:?}", per_key.keys());
    for (k, ns) in &per_key {
        let want: Vec<usize> = range.clone().collect();
        assert_eq!(ns, &want, "{what}: records of {k}");
    }
}

async fn stream_arn(platform: &KinesisPlatform, stream: &str) -> String {
    platform
        .client()
        .describe_stream_summary()
        .stream_name(stream)
        .send()
        .await
        .unwrap()
        .stream_description_summary()
        .unwrap()
        .stream_arn()
        .to_string()
}

/// The registered consumer `name` of `stream`: its ARN, which must be ACTIVE.
async fn active_consumer(platform: &KinesisPlatform, stream: &str, name: &str) -> String {
    let d = platform
        .client()
        .describe_stream_consumer()
        .stream_arn(stream_arn(platform, stream).await)
        .consumer_name(name)
        .send()
        .await
        .expect("the group's stream consumer is registered");
    let c = d.consumer_description().unwrap();
    assert_eq!(
        c.consumer_status(),
        &aws_sdk_kinesis::types::ConsumerStatus::Active
    );
    c.consumer_arn().to_string()
}

/// Whether the server refuses another subscription of `consumer_arn` to `shard` because one is
/// open (the member's own).
async fn subscription_held(platform: &KinesisPlatform, consumer_arn: &str, shard: &str) -> bool {
    let r = platform
        .client()
        .subscribe_to_shard()
        .consumer_arn(consumer_arn)
        .shard_id(shard)
        .starting_position(
            aws_sdk_kinesis::types::StartingPosition::builder()
                .r#type(aws_sdk_kinesis::types::ShardIteratorType::Latest)
                .build()
                .unwrap(),
        )
        .send()
        .await;
    match r {
        Err(e) => e
            .as_service_error()
            .is_some_and(|s| s.is_resource_in_use_exception()),
        Ok(mut out) => match out.event_stream.recv().await {
            Err(e) => format!("{e:?}").contains("ResourceInUse"),
            Ok(_) => false,
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn efo_delivers_in_order_reports_lag_and_resumes_from_checkpoint() {
    let Some(platform) = platform("efo_kinesis").await else {
        return;
    };
    let stream = create_stream(&platform, "efo", 2).await;
    let producer = platform.producer(ProducerConfig::default()).await.unwrap();
    let group = format!("g-{:08x}", rand::random::<u32>());
    let join = |member: &str| {
        let (platform, group, stream) = (platform.clone(), group.clone(), stream.clone());
        let member = member.to_string();
        async move {
            platform
                .consumer(
                    ConsumerConfig::new(group, [stream])
                        .start(StartFrom::committed_or_earliest())
                        .client_id(member),
                )
                .await
                .unwrap()
        }
    };

    // Phase 0 is written before the member subscribes, phase 1 while it is subscribed.
    send(&producer, &stream, 0..20).await;
    let consumer = join("member-a").await;
    let arn = active_consumer(&platform, &stream, &group).await;
    let mut got = poll_n(&consumer, 20 * KEYS).await;
    assert_exactly(&got, 0..20, "before the subscription");
    for shard in ["shardId-000000000000", "shardId-000000000001"] {
        assert!(
            subscription_held(&platform, &arn, shard).await,
            "the member holds a SubscribeToShard subscription on {shard}"
        );
    }
    send(&producer, &stream, 20..40).await;
    got.extend(poll_n(&consumer, 20 * KEYS).await);
    assert_exactly(&got, 0..40, "before and during the subscription");
    consumer.commit(&last_positions(&got)).await.unwrap();

    // Lag: phase 2 written and not handled yet.
    send(&producer, &stream, 40..50).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let lag = consumer.lag().await.unwrap();
    assert_eq!(lag.len(), 2, "a lag row per held shard: {lag:?}");
    assert!(
        lag.iter().all(|l| l.millis.is_some()),
        "MillisBehindLatest reported: {lag:?}"
    );
    let behind: u64 = lag.iter().map(|l| l.messages).sum();
    assert_eq!(
        behind,
        (10 * KEYS) as u64,
        "lag counts the unhandled records: {lag:?}"
    );
    eprintln!("efo lag with 60 records unhandled: {lag:?}");
    let phase2 = poll_n(&consumer, 10 * KEYS).await;
    assert_exactly(&phase2, 40..50, "phase 2");
    consumer.commit(&last_positions(&phase2)).await.unwrap();
    let lag = consumer.lag().await.unwrap();
    assert_eq!(lag.iter().map(|l| l.messages).sum::<u64>(), 0, "{lag:?}");

    // Phase 3: handled but only the first half per key committed, then the member leaves.
    send(&producer, &stream, 50..70).await;
    let phase3 = poll_n(&consumer, 20 * KEYS).await;
    assert_exactly(&phase3, 50..70, "phase 3");
    let first_half: Vec<Message> = phase3.iter().filter(|m| parse(m).1 < 60).cloned().collect();
    // The checkpoint per shard: the last first-half record (records of a shard arrive in
    // sequence order, and the producer wrote 50..60 before 60..70).
    let mut cut: BTreeMap<TopicPartition, Position> = BTreeMap::new();
    for m in &first_half {
        cut.insert(m.topic_partition(), m.position.clone());
    }
    for m in &phase3 {
        if parse(m).1 >= 60 {
            assert!(
                cut.get(&m.topic_partition())
                    .is_none_or(|c| &m.position > c),
                "a second-half record precedes the checkpoint in its shard"
            );
        }
    }
    consumer
        .commit(&cut.into_iter().collect::<Vec<_>>())
        .await
        .unwrap();
    consumer.close().await.unwrap();

    // A new member resumes after the checkpoint: exactly the second half of phase 3, then
    // records written after the restart.
    let consumer = join("member-b").await;
    let resumed = poll_n(&consumer, 10 * KEYS).await;
    assert_exactly(
        &resumed,
        60..70,
        "after the restart (uncommitted records only)",
    );
    send(&producer, &stream, 70..80).await;
    let after = poll_n(&consumer, 10 * KEYS).await;
    assert_exactly(&after, 70..80, "written after the restart");
    assert!(
        subscription_held(&platform, &arn, "shardId-000000000000").await,
        "the restarted member reads through SubscribeToShard too"
    );
    consumer.close().await.unwrap();
    let _ = platform.admin().await.unwrap().delete_topic(&stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn efo_split_while_consuming_keeps_order_per_key() {
    const PER_PHASE: usize = 25;
    let Some(platform) = platform("efo_kinesis").await else {
        return;
    };
    let stream = create_stream(&platform, "efo-reshard", 1).await;
    let producer = platform.producer(ProducerConfig::default()).await.unwrap();

    type Log = Arc<Mutex<Vec<(String, usize, i32)>>>;
    let handled: Log = Arc::default();
    let group = format!("g-{:08x}", rand::random::<u32>());
    let stop = Arc::new(AtomicBool::new(false));
    let mut members = Vec::new();
    for m in 0..2 {
        let consumer: Arc<dyn ConsumerBackend> = platform
            .consumer(
                ConsumerConfig::new(group.clone(), [stream.clone()])
                    .start(StartFrom::committed_or_earliest())
                    .client_id(format!("member-{m}")),
            )
            .await
            .unwrap();
        let (handled, stop) = (handled.clone(), stop.clone());
        members.push(tokio::spawn(async move {
            while !stop.load(Ordering::Acquire) {
                let msgs = consumer
                    .poll(100, Duration::from_millis(200))
                    .await
                    .expect("poll");
                for m in &msgs {
                    let (k, n) = parse(m);
                    handled.lock().unwrap().push((k, n, m.partition));
                }
                consumer
                    .commit(&last_positions(&msgs))
                    .await
                    .expect("commit");
            }
            consumer.close().await.unwrap();
        }));
    }
    let arn = active_consumer(&platform, &stream, &group).await;

    send(&producer, &stream, 0..PER_PHASE).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while handled.lock().unwrap().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "nothing consumed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        subscription_held(&platform, &arn, "shardId-000000000000").await,
        "the parent is read through SubscribeToShard"
    );
    platform
        .client()
        .split_shard()
        .stream_name(&stream)
        .shard_to_split("shardId-000000000000")
        .new_starting_hash_key((1u128 << 127).to_string())
        .send()
        .await
        .expect("SplitShard");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let shards = platform.shards(&stream).await.unwrap();
        if shards.iter().filter(|s| !s.closed).count() == 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "split never finished: {shards:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    send(&producer, &stream, PER_PHASE..2 * PER_PHASE).await;
    send(&producer, &stream, 2 * PER_PHASE..3 * PER_PHASE).await;

    let total = 3 * PER_PHASE * KEYS;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while handled.lock().unwrap().len() < total {
        assert!(
            tokio::time::Instant::now() < deadline,
            "handled {} of {total} records",
            handled.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Children are read through SubscribeToShard as well.
    let mut child_subscribed = false;
    for shard in ["shardId-000000000001", "shardId-000000000002"] {
        child_subscribed |= subscription_held(&platform, &arn, shard).await;
    }
    assert!(
        child_subscribed,
        "a child shard is read through SubscribeToShard"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Release);
    for m in members {
        m.await.unwrap();
    }

    let handled = handled.lock().unwrap().clone();
    assert_eq!(handled.len(), total, "a record was handled twice");
    let mut per_key: HashMap<String, Vec<usize>> = HashMap::new();
    let mut partitions_of_key: HashMap<String, Vec<i32>> = HashMap::new();
    for (k, n, p) in &handled {
        per_key.entry(k.clone()).or_default().push(*n);
        let ps = partitions_of_key.entry(k.clone()).or_default();
        if ps.last() != Some(p) {
            ps.push(*p);
        }
    }
    for (k, order) in &per_key {
        let want: Vec<usize> = (0..3 * PER_PHASE).collect();
        assert_eq!(order, &want, "order of {k} across the split");
        assert_eq!(
            partitions_of_key[k].first(),
            Some(&0),
            "{k} started in the parent"
        );
        assert!(
            partitions_of_key[k].len() == 2 && partitions_of_key[k][1] >= 1,
            "{k} moved from the parent to one child: {:?}",
            partitions_of_key[k]
        );
    }
    let store = platform.checkpoint_store().await.unwrap();
    let leases = store.list(&format!("{group}/{stream}")).await.unwrap();
    let parent = leases
        .iter()
        .find(|l| l.key == "shardId-000000000000")
        .unwrap();
    assert_eq!(parent.checkpoint.as_deref(), Some(SHARD_END));
    let _ = platform.admin().await.unwrap().delete_topic(&stream).await;
}

/// A server without enhanced fan-out (kinesalite, when `ONCEFLOW_KINESALITE_URL` points at one:
/// the broker scripts do not start it, so this test skips otherwise): `fan_out=efo` fails to
/// join with `Unsupported` naming the server's answer; `fan_out=auto` consumes by polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn efo_unsupported_by_the_server_is_an_error_or_polls_with_auto() {
    let Ok(url) = std::env::var("ONCEFLOW_KINESALITE_URL") else {
        eprintln!("efo_kinesis: SKIPPED: ONCEFLOW_KINESALITE_URL is not set (a server without enhanced fan-out, e.g. kinesalite)");
        return;
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    let efo = onceflow_kinesis::connect(&format!("{url}{sep}fan_out=efo&idle_ms=100"))
        .await
        .unwrap();
    let stream = create_stream(&efo, "efo-unsupported", 1).await;
    let err = match efo
        .consumer(ConsumerConfig::new("g", [stream.clone()]).start(StartFrom::Earliest))
        .await
    {
        Err(e) => e,
        Ok(_) => panic!("fan_out=efo joined a server without enhanced fan-out"),
    };
    eprintln!("fan_out=efo on a server without it: {err}");
    assert_eq!(err.kind(), onceflow_core::ErrorKind::Unsupported, "{err}");
    assert!(err.message().contains("UnknownOperation"), "{err}");

    let auto = onceflow_kinesis::connect(&format!("{url}{sep}fan_out=auto&idle_ms=100"))
        .await
        .unwrap();
    let producer = auto.producer(ProducerConfig::default()).await.unwrap();
    send(&producer, &stream, 0..5).await;
    let consumer = auto
        .consumer(ConsumerConfig::new("g", [stream.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let got = poll_n(&consumer, 5 * KEYS).await;
    assert_exactly(
        &got,
        0..5,
        "fan_out=auto on a server without enhanced fan-out",
    );
    consumer.close().await.unwrap();
    let _ = auto.admin().await.unwrap().delete_topic(&stream).await;
}

/// A loopback TCP relay to `target` whose connections can all be cut at once (a network
/// failure between the consumer and the server; the server itself is untouched).
struct Relay {
    port: u16,
    cut: tokio::sync::watch::Sender<u64>,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
}

impl Relay {
    async fn start(target: std::net::SocketAddr) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (cuts, count) = (cut.clone(), accepted.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, Ordering::Relaxed);
                let mut cut = cuts.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Relay {
            port,
            cut,
            accepted,
        }
    }

    /// Drops every open connection.
    fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }
}

/// The connection carrying the subscription drops: the member subscribes again after the last
/// `ContinuationSequenceNumber`, so nothing is lost and nothing delivered twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn efo_resubscribes_after_a_dropped_connection() {
    let Some(direct) = platform("efo_kinesis").await else {
        return;
    };
    let url = std::env::var("ONCEFLOW_KINESIS_URL").unwrap();
    let parsed = url::Url::parse(&url).unwrap();
    let target: std::net::SocketAddr = format!(
        "{}:{}",
        parsed.host_str().unwrap(),
        parsed.port().unwrap_or(80)
    )
    .parse()
    .expect("ONCEFLOW_KINESIS_URL names an IP address and port");
    let relay = Relay::start(target).await;
    let query = parsed.query().unwrap_or("");
    let relayed = onceflow_kinesis::connect(&format!(
        "kinesis://127.0.0.1:{}?{query}&fan_out=efo&lease_ms=2000&idle_ms=100",
        relay.port
    ))
    .await
    .unwrap();
    let stream = create_stream(&direct, "efo-drop", 1).await;
    let producer = direct.producer(ProducerConfig::default()).await.unwrap();
    let group = format!("g-{:08x}", rand::random::<u32>());
    let consumer = relayed
        .consumer(
            ConsumerConfig::new(group.clone(), [stream.clone()])
                .start(StartFrom::Earliest)
                .client_id("member"),
        )
        .await
        .unwrap();
    send(&producer, &stream, 0..20).await;
    let mut got = poll_n(&consumer, 20 * KEYS).await;
    assert_exactly(&got, 0..20, "before the connection drops");
    let arn = active_consumer(&direct, &stream, &group).await;

    let before = relay.accepted.load(Ordering::Relaxed);
    relay.cut();
    send(&producer, &stream, 20..40).await;
    got.extend(poll_n(&consumer, 20 * KEYS).await);
    assert_exactly(&got, 0..40, "across the dropped connection");
    assert!(
        relay.accepted.load(Ordering::Relaxed) > before,
        "the member connected again"
    );
    assert!(
        subscription_held(&direct, &arn, "shardId-000000000000").await,
        "the member subscribed again"
    );
    consumer.close().await.unwrap();
    let _ = direct.admin().await.unwrap().delete_topic(&stream).await;
}
