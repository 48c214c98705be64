//! Resharding on a real Kinesis-compatible server (`tests/brokers/up.sh kinesis`): a shard is
//! split while a group of two members consumes it. Every record is handled exactly once by the
//! members (each commits what it polled), and per partition key the records are handled in the
//! order they were written, across the parent shard and its children: a child is read only
//! after its parent was read to its end and checkpointed `SHARD_END`.
//!
//! Runs when `ONCEFLOW_KINESIS_URL` is set; without it the test says it skipped, and with
//! `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) that is a failure.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use onceflow_conformance::harness::broker_url;
use onceflow_core::{
    ConsumerBackend, ConsumerConfig, PlatformBackend, Position, ProducerConfig, Record, StartFrom,
    TopicPartition, TopicSpec,
};
use onceflow_kinesis::SHARD_END;

const KEYS: usize = 8;
const PER_PHASE: usize = 25;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn split_while_consuming_keeps_order_per_key() {
    let url = match broker_url("ONCEFLOW_KINESIS_URL", "kinesis") {
        Ok(u) => u,
        Err(reason) => {
            eprintln!("reshard_kinesis: SKIPPED: {reason}");
            return;
        }
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    let platform = onceflow_kinesis::connect(&format!("{url}{sep}lease_ms=2000&idle_ms=100"))
        .await
        .unwrap();
    let stream = format!("reshard-{:016x}", rand::random::<u64>());
    platform
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(stream.clone(), 1))
        .await
        .unwrap();
    let producer = platform.producer(ProducerConfig::default()).await.unwrap();
    let send_phase = |phase: usize| {
        let (producer, stream) = (producer.clone(), stream.clone());
        async move {
            let mut records = Vec::new();
            for i in 0..PER_PHASE {
                for k in 0..KEYS {
                    let n = phase * PER_PHASE + i;
                    records.push(
                        Record::new(stream.clone(), format!("key-{k}/{n}")).key(format!("key-{k}")),
                    );
                }
            }
            for r in producer.send_batch(records).await {
                r.expect("send");
            }
        }
    };

    // Two members of one group: each polls, records what it handled, and commits it.
    type Log = Arc<Mutex<Vec<(String, usize, i32)>>>;
    let handled: Log = Arc::default();
    let group = format!("g-{:08x}", rand::random::<u32>());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
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
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                let msgs = consumer
                    .poll(100, Duration::from_millis(200))
                    .await
                    .expect("poll");
                let mut last: BTreeMap<TopicPartition, Position> = BTreeMap::new();
                for m in &msgs {
                    let text = String::from_utf8(m.payload.to_vec()).unwrap();
                    let (key, n) = text.split_once('/').unwrap();
                    handled.lock().unwrap().push((
                        key.to_string(),
                        n.parse().unwrap(),
                        m.partition,
                    ));
                    last.insert(m.topic_partition(), m.position.clone());
                }
                let positions: Vec<_> = last.into_iter().collect();
                consumer.commit(&positions).await.expect("commit");
            }
            consumer.close().await.unwrap();
        }));
    }

    send_phase(0).await;
    // Wait until the members are reading, then split the only shard in two halves.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while handled.lock().unwrap().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "nothing consumed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = platform.client();
    client
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
    send_phase(1).await;
    send_phase(2).await;

    let total = 3 * PER_PHASE * KEYS;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while handled.lock().unwrap().len() < total {
        assert!(
            tokio::time::Instant::now() < deadline,
            "handled {} of {total} records",
            handled.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Release);
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
    // The parent is finished in the lease table.
    let store = platform.checkpoint_store().await.unwrap();
    let leases = store.list(&format!("{group}/{stream}")).await.unwrap();
    let parent = leases
        .iter()
        .find(|l| l.key == "shardId-000000000000")
        .unwrap();
    assert_eq!(parent.checkpoint.as_deref(), Some(SHARD_END));
    assert!(
        leases
            .iter()
            .filter(|l| l.parents.contains(&parent.key))
            .count()
            == 2
    );
    let _ = platform.admin().await.unwrap().delete_topic(&stream).await;
}
