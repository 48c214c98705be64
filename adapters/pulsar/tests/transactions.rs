//! Pulsar transactions (PIP-31, issue #27) on a real Pulsar standalone with
//! `transactionCoordinatorEnabled=true` (`tests/brokers/up.sh pulsar`, which prints
//! `ONCEFLOW_PULSAR_URL` and `ONCEFLOW_PULSAR_ADMIN_URL`). Without the URLs every test is
//! skipped with that reason; `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`) makes a missing
//! broker a failure.
//!
//! - `committed_sends_are_read_and_aborted_ones_never`: what a transaction sent is read once
//!   it commits; what an aborted one sent is never delivered, also to a plain consumer.
//! - `acks_of_an_aborted_transaction_are_void`: inputs acknowledged in an aborted transaction
//!   come again to the group; acknowledged in a committed one, never.
//! - `a_transaction_past_its_timeout_is_aborted`: the coordinator aborts a transaction left
//!   open past `transaction_timeout_ms`; its commit is `Aborted`, its sends never delivered.
//! - `redelivery_after_an_abort_keeps_what_a_later_transaction_committed`: inputs acknowledged
//!   in an aborted transaction come again through `rewind_uncommitted` (what the pipeline
//!   does after an abort), and those a later transaction committed past them never do (a seek
//!   to the committed position would make them unacknowledged again).
//! - `a_member_that_lost_the_partition_cannot_commit`: the failover partition moved to another
//!   member before the commit: `Fenced`, nothing of it read, the inputs go to the new member.

use std::time::{Duration, Instant};

use onceflow_core::{
    Client, Consumer, ConsumerConfig, ErrorKind, Message, ProducerConfig, Record, StartFrom,
    TopicPartition, TopicSpec,
};

fn require(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but {var} is not set (tests/brokers/up.sh pulsar)"
            );
            eprintln!("transactions: SKIPPED: {var} is not set (tests/brokers/up.sh pulsar)");
            None
        }
    }
}

/// The broker's URL with transactions on.
fn url() -> Option<String> {
    let service = require("ONCEFLOW_PULSAR_URL")?;
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL")?;
    Some(format!("{service}?admin={admin}&transactions=true"))
}

fn name(prefix: &str) -> String {
    format!("{prefix}-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

fn text(m: &Message) -> String {
    String::from_utf8_lossy(&m.payload).into_owned()
}

/// Reads `topic` as a new group from the earliest message until `last` was read (at most
/// 60 s); returns the payloads read, in order.
async fn read_until(client: &Client, topic: &str, last: &str) -> Vec<String> {
    let c = client
        .consumer(ConsumerConfig::new(name("reader"), [topic]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while !out.iter().any(|t| t == last) {
        assert!(
            Instant::now() < deadline,
            "{last} not read within 60 s: {out:?}"
        );
        out.extend(
            c.poll(100, Duration::from_millis(200))
                .await
                .unwrap()
                .iter()
                .map(text),
        );
    }
    c.close().await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_sends_are_read_and_aborted_ones_never() {
    let Some(url) = url() else { return };
    let client = Client::new(onceflow_pulsar::connect(&url).await.unwrap());
    assert!(client.capabilities().transactions);
    let topic = name("txn-out");
    let producer = client
        .producer(ProducerConfig::new().transactional_id(name("txn-producer")))
        .await
        .unwrap();

    let mut t = producer.begin().await.unwrap();
    for r in t
        .send_batch(
            (0..10)
                .map(|i| Record::new(&topic, format!("a{i}")))
                .collect(),
        )
        .await
    {
        r.unwrap();
    }
    // One transaction at a time per producer, as on Kafka.
    let Err(second) = producer.begin().await else {
        panic!("a transaction is open");
    };
    assert_eq!(second.kind(), ErrorKind::Config, "{second}");
    t.commit().await.unwrap();

    let mut t = producer.begin().await.unwrap();
    for i in 0..10 {
        t.send(Record::new(&topic, format!("x{i}"))).await.unwrap();
    }
    t.abort().await.unwrap();

    // Dropped without commit: aborted as well.
    let mut t = producer.begin().await.unwrap();
    t.send(Record::new(&topic, "dropped")).await.unwrap();
    drop(t);
    // The background abort of the dropped one has to end before the next begins.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut t = loop {
        match producer.begin().await {
            Ok(t) => break t,
            Err(e) if Instant::now() < deadline => {
                eprintln!("begin after a drop: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    for i in 0..10 {
        t.send(Record::new(&topic, format!("b{i}"))).await.unwrap();
    }
    t.commit().await.unwrap();
    // Plain sends after the transactions, to know where to stop reading.
    let plain = client.producer(ProducerConfig::new()).await.unwrap();
    plain.send(Record::new(&topic, "end")).await.unwrap();

    let read = read_until(&client, &topic, "end").await;
    let expected: Vec<String> = (0..10)
        .map(|i| format!("a{i}"))
        .chain((0..10).map(|i| format!("b{i}")))
        .chain(["end".to_string()])
        .collect();
    assert_eq!(
        read, expected,
        "committed once each, in order; aborted never"
    );

    // A client without transactions reads the same (the broker filters aborted messages).
    let service = require("ONCEFLOW_PULSAR_URL").unwrap();
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL").unwrap();
    let plain_client = Client::new(
        onceflow_pulsar::connect(&format!("{service}?admin={admin}"))
            .await
            .unwrap(),
    );
    assert_eq!(read_until(&plain_client, &topic, "end").await, expected);
    producer.close().await.unwrap();
}

async fn poll_n(c: &Consumer, n: usize) -> Vec<Message> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} within 60 s: {:?}",
            out.len(),
            out.iter().map(text).collect::<Vec<_>>()
        );
        out.extend(
            c.poll(n - out.len(), Duration::from_millis(200))
                .await
                .unwrap(),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_of_an_aborted_transaction_are_void() {
    let Some(url) = url() else { return };
    let client = Client::new(onceflow_pulsar::connect(&url).await.unwrap());
    let input = name("txn-in");
    let output = name("txn-out");
    let group = name("txn-group");
    let plain = client.producer(ProducerConfig::new()).await.unwrap();
    for i in 0..10 {
        plain
            .send(Record::new(&input, format!("in{i}")))
            .await
            .unwrap();
    }
    let producer = client
        .producer(ProducerConfig::new().transactional_id(name("txn-pipeline")))
        .await
        .unwrap();
    // The group's committed position, else the earliest message (the default start).
    let consume = || client.consumer(ConsumerConfig::new(&group, [input.as_str()]));

    // Round 1: outputs sent and inputs acknowledged in a transaction that is aborted.
    let c = consume().await.unwrap();
    let msgs = poll_n(&c, 10).await;
    assert_eq!(
        msgs.iter().map(text).collect::<Vec<_>>(),
        (0..10).map(|i| format!("in{i}")).collect::<Vec<_>>()
    );
    let last = msgs.last().unwrap();
    let positions = vec![(
        TopicPartition::new(&input, last.partition),
        last.position.clone(),
    )];
    let mut t = producer.begin().await.unwrap();
    for m in &msgs {
        t.send(Record::new(&output, format!("out-{}", text(m))))
            .await
            .unwrap();
    }
    t.commit_offsets(&c.group_metadata().unwrap(), &positions)
        .await
        .unwrap();
    t.abort().await.unwrap();
    // Nothing is committed; the member still holds the inputs (as after an aborted Kafka
    // transaction, it reads them again only after a seek, as the pipeline does).
    assert_eq!(
        c.committed(&[positions[0].0.clone()]).await.unwrap()[0].next,
        None,
        "an aborted transaction commits no positions"
    );
    c.close().await.unwrap();

    // Round 2: the group gets every input again; this time the transaction commits.
    let c = consume().await.unwrap();
    let again = poll_n(&c, 10).await;
    assert_eq!(
        again.iter().map(text).collect::<Vec<_>>(),
        (0..10).map(|i| format!("in{i}")).collect::<Vec<_>>(),
        "acknowledged in an aborted transaction: delivered again to the group"
    );
    let last = again.last().unwrap();
    let positions = vec![(
        TopicPartition::new(&input, last.partition),
        last.position.clone(),
    )];
    let mut t = producer.begin().await.unwrap();
    for m in &again {
        t.send(Record::new(&output, format!("out-{}", text(m))))
            .await
            .unwrap();
    }
    t.commit_offsets(&c.group_metadata().unwrap(), &positions)
        .await
        .unwrap();
    t.commit().await.unwrap();
    c.close().await.unwrap();

    // Round 3: nothing of the inputs comes again, only what is written after.
    plain.send(Record::new(&input, "in-after")).await.unwrap();
    let c = consume().await.unwrap();
    let next = poll_n(&c, 1).await;
    assert_eq!(
        text(&next[0]),
        "in-after",
        "acknowledged in a committed transaction: never again"
    );
    c.close().await.unwrap();

    // The output holds round 2's outputs once each, none of round 1's.
    plain.send(Record::new(&output, "end")).await.unwrap();
    let read = read_until(&client, &output, "end").await;
    let expected: Vec<String> = (0..10)
        .map(|i| format!("out-in{i}"))
        .chain(["end".to_string()])
        .collect();
    assert_eq!(read, expected);
    producer.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_past_its_timeout_is_aborted() {
    let Some(url) = url() else { return };
    let client = Client::new(
        onceflow_pulsar::connect(&format!("{url}&transaction_timeout_ms=1000"))
            .await
            .unwrap(),
    );
    let topic = name("txn-timeout");
    let producer = client
        .producer(ProducerConfig::new().transactional_id(name("txn-slow")))
        .await
        .unwrap();
    let mut t = producer.begin().await.unwrap();
    t.send(Record::new(&topic, "late")).await.unwrap();
    // Past the timeout the coordinator's timeout tracker aborts it (the tracker ticks well
    // within a second on the test broker; txn.rs's unit test watches it happen through the
    // admin API); a commit then finds it no longer open.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let e = t.commit().await.expect_err("timed out");
    assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");

    let plain = client.producer(ProducerConfig::new()).await.unwrap();
    plain.send(Record::new(&topic, "end")).await.unwrap();
    assert_eq!(
        read_until(&client, &topic, "end").await,
        vec!["end".to_string()]
    );
}

/// A member whose partition moved to another member cannot commit the positions it
/// acknowledged there in a transaction: the commit is `Fenced`, the transaction aborted,
/// nothing it wrote is read. (Failover on a partitioned topic: partition `i` goes to the
/// member at `i % members` in the members sorted by name, so a second member named before the
/// first takes partition 0.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_lost_the_partition_cannot_commit() {
    let Some(url) = url() else { return };
    let client = Client::new(onceflow_pulsar::connect(&url).await.unwrap());
    let input = name("txn-moved-in");
    let output = name("txn-moved-out");
    let group = name("txn-moved");
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(input.clone(), 2))
        .await
        .unwrap();
    let plain = client.producer(ProducerConfig::new()).await.unwrap();
    for i in 0..3 {
        plain
            .send(Record::new(&input, format!("in{i}")).partition(0))
            .await
            .unwrap();
    }
    let old = client
        .consumer(ConsumerConfig::new(&group, [input.as_str()]).client_id("member-b"))
        .await
        .unwrap();
    let got = poll_n(&old, 3).await;
    let last = got.last().unwrap();
    let tp = TopicPartition::new(&input, 0);
    assert_eq!(last.topic_partition(), tp);
    let producer = client
        .producer(ProducerConfig::new().transactional_id(name("txn-moved")))
        .await
        .unwrap();
    let mut t = producer.begin().await.unwrap();
    t.send(Record::new(&output, "from-the-old-member"))
        .await
        .unwrap();
    t.commit_offsets(
        &old.group_metadata().unwrap(),
        &[(tp.clone(), last.position.clone())],
    )
    .await
    .unwrap();
    // A member named before the first joins: partition 0 becomes its.
    let heir = client
        .consumer(ConsumerConfig::new(&group, [input.as_str()]).client_id("member-a"))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !heir.assignment().contains(&tp) {
        assert!(Instant::now() < deadline, "partition 0 never moved");
        heir.poll(10, Duration::from_millis(200)).await.unwrap();
    }
    let e = t.commit().await.expect_err("the partition moved");
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    plain.send(Record::new(&output, "end")).await.unwrap();
    assert_eq!(
        read_until(&client, &output, "end").await,
        vec!["end".to_string()],
        "the fenced transaction's output is never read"
    );
    // The heir gets the inputs: none was acknowledged.
    let again = poll_n(&heir, 3).await;
    assert_eq!(
        again.iter().map(text).collect::<Vec<_>>(),
        vec!["in0", "in1", "in2"]
    );
    heir.close().await.unwrap();
    old.close().await.unwrap();
}

/// A hole in the acknowledgements: transaction 1 acknowledges in0..in2 and stays open while
/// transaction 2 acknowledges in3..in5 and commits; then transaction 1 aborts. What the pipeline
/// does after an abort, `rewind_uncommitted`, gives out in0..in2 and in6..in9 again, in
/// order, and never in3..in5: a seek to the committed position (in0, the cursor's mark-delete
/// position + 1) resets the cursor and makes in3..in5 unacknowledged again, and a pipeline whose
/// commit marker for transaction 2 was lost with a killed process wrote them twice (#27).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_after_an_abort_keeps_what_a_later_transaction_committed() {
    let Some(url) = url() else { return };
    let client = Client::new(onceflow_pulsar::connect(&url).await.unwrap());
    let input = name("txn-hole-in");
    let group = name("txn-hole-group");
    let plain = client.producer(ProducerConfig::new()).await.unwrap();
    for i in 0..10 {
        plain
            .send(Record::new(&input, format!("in{i}")))
            .await
            .unwrap();
    }
    let first = client
        .producer(ProducerConfig::new().transactional_id(name("txn-first")))
        .await
        .unwrap();
    let second = client
        .producer(ProducerConfig::new().transactional_id(name("txn-second")))
        .await
        .unwrap();
    let c = client
        .consumer(ConsumerConfig::new(&group, [input.as_str()]))
        .await
        .unwrap();
    let msgs = poll_n(&c, 10).await;
    let upto = |i: usize| {
        vec![(
            TopicPartition::new(&input, msgs[i].partition),
            msgs[i].position.clone(),
        )]
    };
    let meta = c.group_metadata().unwrap();
    let mut t1 = first.begin().await.unwrap();
    t1.commit_offsets(&meta, &upto(2)).await.unwrap();
    let mut t2 = second.begin().await.unwrap();
    t2.commit_offsets(&meta, &upto(5)).await.unwrap();
    t2.commit().await.unwrap();
    t1.abort().await.unwrap();

    let tp = TopicPartition::new(&input, msgs[0].partition);
    let left = c.rewind_uncommitted(&[tp]).await.unwrap();
    assert!(left.is_empty(), "Pulsar redelivers every partition itself");
    let again = poll_n(&c, 7).await;
    let expected: Vec<String> = [0, 1, 2, 6, 7, 8, 9]
        .iter()
        .map(|i| format!("in{i}"))
        .collect();
    assert_eq!(
        again.iter().map(text).collect::<Vec<_>>(),
        expected,
        "the aborted transaction's inputs and the undelivered rest, in order"
    );
    // Nothing else comes: in3..in5 stay acknowledged (polled for 3 s).
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(3) {
        let more = c.poll(10, Duration::from_millis(200)).await.unwrap();
        assert!(
            more.is_empty(),
            "delivered again although committed or still held: {:?}",
            more.iter().map(text).collect::<Vec<_>>()
        );
    }
    c.close().await.unwrap();
    // A new member of the group gets the same, from the broker's cursor.
    let c = client
        .consumer(ConsumerConfig::new(&group, [input.as_str()]))
        .await
        .unwrap();
    let fresh = poll_n(&c, 7).await;
    assert_eq!(fresh.iter().map(text).collect::<Vec<_>>(), expected);
    c.close().await.unwrap();
    first.close().await.unwrap();
    second.close().await.unwrap();
}

/// A member that dies with a transaction open (its acknowledgements pending in it): the next
/// member of the group gets those inputs once the coordinator has aborted the transaction at
/// its timeout, and every other input at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_of_a_dead_members_open_transaction_come_after_its_timeout() {
    let Some(url) = url() else { return };
    let client = Client::new(
        onceflow_pulsar::connect(&format!("{url}&transaction_timeout_ms=5000"))
            .await
            .unwrap(),
    );
    let input = name("txn-dead-in");
    let group = name("txn-dead-group");
    let plain = client.producer(ProducerConfig::new()).await.unwrap();
    for i in 0..10 {
        plain
            .send(Record::new(&input, format!("in{i}")))
            .await
            .unwrap();
    }
    let producer = client
        .producer(ProducerConfig::new().transactional_id(name("txn-dead")))
        .await
        .unwrap();
    let c = client
        .consumer(ConsumerConfig::new(&group, [input.as_str()]))
        .await
        .unwrap();
    let msgs = poll_n(&c, 10).await;
    let mut t = producer.begin().await.unwrap();
    t.commit_offsets(
        &c.group_metadata().unwrap(),
        &[(
            TopicPartition::new(&input, msgs[4].partition),
            msgs[4].position.clone(),
        )],
    )
    .await
    .unwrap();
    // The member dies: its transaction is never ended, its consumer goes away.
    std::mem::forget(t);
    c.close().await.unwrap();
    let opened = Instant::now();

    let c = client
        .consumer(ConsumerConfig::new(&group, [input.as_str()]))
        .await
        .unwrap();
    let mut got: Vec<(u128, String)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while got.len() < 10 {
        assert!(Instant::now() < deadline, "within 60 s only {got:?}");
        for m in c.poll(10, Duration::from_millis(200)).await.unwrap() {
            got.push((opened.elapsed().as_millis(), text(&m)));
        }
    }
    eprintln!("next member got: {got:?}");
    let mut names: Vec<String> = got.iter().map(|(_, t)| t.clone()).collect();
    names.sort();
    let mut expected: Vec<String> = (0..10).map(|i| format!("in{i}")).collect();
    expected.sort();
    assert_eq!(names, expected, "every input once");
    c.close().await.unwrap();
}
