//! `idle_heartbeat_ms` on a real nats-server: quiet and prompt while the server is healthy, and
//! a server that stops answering is noticed within the heartbeat's grace, long before the
//! pull request's expiry. Every log line is captured (`onceflow_conformance::logs`), so the
//! tests of this binary run one at a time.

use std::time::{Duration, Instant};

use bytes::Bytes;
use onceflow_conformance::logs;
use onceflow_core::{
    ConsumerBackend, ConsumerConfig, Message, PlatformBackend, ProducerConfig, Record, StartFrom,
    TopicSpec,
};
use onceflow_jetstream::JetStreamPlatform;

mod common;
use common::{name, platform, take, topic, PrivateServer};

/// One test at a time: each reads the log lines written while it ran.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A consumer of a new group on `t`, from the earliest message, with these options.
async fn open(
    p: &JetStreamPlatform,
    t: &str,
    options: &[(&str, &str)],
) -> std::sync::Arc<dyn ConsumerBackend> {
    let mut cfg = ConsumerConfig::new(name("g"), [t.to_string()]).start(StartFrom::Earliest);
    for (k, v) in options {
        cfg.options.insert(k.to_string(), v.to_string());
    }
    p.consumer(cfg).await.unwrap()
}

/// The warnings and errors of the JetStream adapter among `lines`.
fn warnings(lines: &str) -> Vec<&str> {
    lines
        .lines()
        .filter(|l| {
            (l.contains(" WARN ") || l.contains("ERROR")) && l.contains("onceflow_jetstream")
        })
        .collect()
}

/// Polls until a message comes; how long that took from `since`. Fails after `limit`.
async fn next(c: &dyn ConsumerBackend, since: Instant, limit: Duration) -> (Message, Duration) {
    loop {
        let got = c.poll(10, Duration::from_millis(50)).await.unwrap();
        if let Some(m) = got.into_iter().next() {
            return (m, since.elapsed());
        }
        assert!(since.elapsed() < limit, "nothing read within {limit:?}");
    }
}

/// On a healthy server an idle stream is not a dead one: the server sends idle heartbeats only
/// while a pull request waits, and ends each request at its expiry with a 408 status. Before,
/// async-nats' batch swallowed the first heartbeat without waking the reader, the request's
/// 408 then sat unread until the fetch task's give-up timer took it for a dead server: a
/// warning every pull cycle, and a message published meanwhile went to the abandoned request
/// and came back only after `ack_wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_heartbeat_on_a_healthy_server_is_quiet_and_delivers_at_once() {
    let _serial = SERIAL.lock().await;
    logs::capture();
    let test = "an_idle_heartbeat_on_a_healthy_server_is_quiet_and_delivers_at_once";
    let Some(p) = platform(test).await else {
        return;
    };
    let t = topic(&p, "js-hb-idle", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    let mark = logs::captured().len();
    let c = open(
        &p,
        &t,
        &[("idle_heartbeat_ms", "100"), ("pull_expires_ms", "500")],
    )
    .await;
    for round in 0..3u32 {
        // Idle for four pull expiries and more: each request gets its heartbeats, then its
        // 408; each round sends at another point of a request's life (a third of a request
        // later than the round before).
        let idle = Instant::now();
        while idle.elapsed() < Duration::from_millis(2000 + 170 * u64::from(round)) {
            let got = c.poll(10, Duration::from_millis(200)).await.unwrap();
            assert!(got.is_empty(), "{got:?}");
        }
        let sent = Instant::now();
        prod.send(Record::new(t.clone(), format!("m{round}")))
            .await
            .unwrap();
        let (m, took) = next(c.as_ref(), sent, Duration::from_secs(5)).await;
        assert_eq!(m.payload, Bytes::from(format!("m{round}")));
        eprintln!("round {round}: read {} ms after the send", took.as_millis());
        assert!(
            took < Duration::from_millis(400),
            "round {round}: a message sent after an idle period read after {took:?} (the \
             request waiting for it was taken for dead)"
        );
        c.commit(&[(m.topic_partition(), m.position.clone())])
            .await
            .unwrap();
    }
    c.close().await.unwrap();
    let lines = logs::captured()[mark..].to_string();
    let warned = warnings(&lines);
    assert!(
        warned.is_empty(),
        "warnings on a healthy server: {warned:#?}"
    );
}

/// A server that stops answering (SIGSTOP: its connections stay open, so the client notices
/// only by what stops coming) is noticed by the missing idle heartbeats within 2 heartbeats
/// (at least 500 ms), not at the request's expiry (5 s here) plus 5 s, and said once; when it
/// answers again the consumer reads at once. A server killed (SIGKILL) and restarted is
/// noticed the same way, and read from again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_heartbeat_notices_a_server_that_hangs_or_dies() {
    let _serial = SERIAL.lock().await;
    logs::capture();
    let test = "an_idle_heartbeat_notices_a_server_that_hangs_or_dies";
    if platform(test).await.is_none() {
        return;
    }
    let Some(mut server) = PrivateServer::new(test) else {
        return;
    };
    server.start(true).await;
    let p = onceflow_jetstream::connect(&format!("{}?request_timeout_ms=1000", server.url()))
        .await
        .unwrap();
    let t = name("js-hb-dead");
    p.admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(t.clone(), 1))
        .await
        .unwrap();
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "a")).await.unwrap();
    let c = open(
        &p,
        &t,
        &[("idle_heartbeat_ms", "100"), ("pull_expires_ms", "5000")],
    )
    .await;
    assert_eq!(take(c.as_ref(), 1).await[0].payload, Bytes::from("a"));
    // Idle on a healthy server: quiet.
    let mark = logs::captured().len();
    let idle = Instant::now();
    while idle.elapsed() < Duration::from_secs(1) {
        c.poll(10, Duration::from_millis(100)).await.unwrap();
    }
    let lines = logs::captured()[mark..].to_string();
    assert!(warnings(&lines).is_empty(), "{:#?}", warnings(&lines));

    for (what, kill) in [("SIGSTOP", false), ("SIGKILL", true)] {
        let mark = logs::captured().len();
        let gone = Instant::now();
        if kill {
            server.kill();
        } else {
            server.freeze(true);
        }
        let noticed = loop {
            c.poll(10, Duration::from_millis(50)).await.unwrap();
            let lines = logs::captured()[mark..].to_string();
            if warnings(&lines)
                .iter()
                .any(|l| l.contains("missed its idle heartbeats") && l.contains(&t))
            {
                break gone.elapsed();
            }
            assert!(
                gone.elapsed() < Duration::from_secs(4),
                "{what}: no missed-heartbeat warning within 4 s: {lines}"
            );
        };
        eprintln!("{what}: noticed after {} ms", noticed.as_millis());
        assert!(
            noticed < Duration::from_millis(1500),
            "{what}: a request expiring after 5 s was given up after {noticed:?}"
        );
        // Still gone a while: said once, not for every request made meanwhile.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let lines = logs::captured()[mark..].to_string();
        let said = warnings(&lines)
            .iter()
            .filter(|l| l.contains("missed its idle heartbeats"))
            .count();
        assert_eq!(said, 1, "{what}: {lines}");

        if kill {
            server.start(true).await;
            common::reconnected(&p).await;
        } else {
            server.freeze(false);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let payload = format!("after {what}");
        while let Err(e) = prod.send(Record::new(t.clone(), payload.clone())).await {
            assert!(e.is_retriable(), "{e}");
            assert!(Instant::now() < deadline, "{e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (m, took) = next(c.as_ref(), Instant::now(), Duration::from_secs(15)).await;
        assert_eq!(m.payload, Bytes::from(payload));
        c.commit(&[(m.topic_partition(), m.position.clone())])
            .await
            .unwrap();
        eprintln!("{what}: read {} ms after the send", took.as_millis());
        assert!(
            took < Duration::from_secs(3),
            "{what}: read {took:?} after the send"
        );
    }
    c.close().await.unwrap();
}
