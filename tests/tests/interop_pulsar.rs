//! Interop with another Pulsar client, pulsar-client (PyPI, the official C++-based Python
//! client), on the same real Pulsar standalone:
//!
//! - `pulsar_client_trace_continues_in_onceflow`: `tests/interop/pulsar_produce_traced.py`
//!   produces with a W3C `traceparent` property per message (one trace); onceflow's idempotent
//!   consumer runs each handler inside that trace and sees pulsar-client's properties and key.
//! - `onceflow_messages_reach_pulsar_client`: messages onceflow produces are read by
//!   `tests/interop/pulsar_read_properties.py` intact (payload, partition key, event time,
//!   properties with their names' case, the injected `traceparent`).
//!
//! - `pulsar_client_reads_committed_transactions_only`: what onceflow sends in Pulsar
//!   transactions (`transactions=true`) reaches pulsar-client once committed, never aborted.
//!
//! pulsar-client is installed once by `tests/interop/pulsar-env.sh` into
//! `~/.cache/onceflow/venv-pulsar-interop`. Runs when `ONCEFLOW_PULSAR_URL` is set; without it
//! each test says it skipped, and with `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) that is a
//! failure.

use std::collections::BTreeMap;

use onceflow_conformance::interop::{handle_in_trace, run_py, unique_name as name, url_or_skip};
use onceflow_core::{Client, ConsumerConfig, ProducerConfig, Record, StartFrom, TopicSpec};

const ENV: &str = "pulsar-env.sh";

fn url(test: &str) -> Option<String> {
    url_or_skip("ONCEFLOW_PULSAR_URL", "pulsar", "interop_pulsar", test)
}

/// The onceflow URL: the service URL plus the admin URL from `ONCEFLOW_PULSAR_ADMIN_URL`.
fn onceflow_url(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    match std::env::var("ONCEFLOW_PULSAR_ADMIN_URL") {
        Ok(admin) if !url.contains("admin=") => format!("{url}{sep}admin={admin}"),
        _ => url.to_string(),
    }
}

/// The service URL pulsar-client connects to (no onceflow options).
fn service_url(url: &str) -> String {
    url.split('?').next().unwrap().to_string()
}

async fn topic(client: &Client) -> String {
    let t = name("interop");
    let spec = TopicSpec::new(t.clone(), 1);
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&spec)
        .await
        .unwrap();
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulsar_client_trace_continues_in_onceflow() {
    let Some(url) = url("pulsar_client_trace_continues_in_onceflow") else {
        return;
    };
    let client = Client::new(onceflow_pulsar::connect(&onceflow_url(&url)).await.unwrap());
    let t = topic(&client).await;
    let trace_id = format!("{:032x}", rand::random::<u128>() | 1);
    let n = 5;
    let published = run_py(
        ENV,
        "pulsar_produce_traced.py",
        &[&service_url(&url), &t, &n.to_string(), &trace_id],
    );
    let published: Vec<&str> = published
        .lines()
        .filter(|l| l.starts_with("PUBLISHED "))
        .collect();
    assert_eq!(published.len(), n, "{published:?}");

    let consumer = client
        .consumer(ConsumerConfig::new(name("g"), [t.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let seen: Vec<_> = handle_in_trace(consumer, n)
        .await
        .into_iter()
        .map(|(tid, m)| {
            let py = m.headers.get_str("X-Py-Header").map(String::from);
            let tp = m.headers.get_str("traceparent").map(String::from);
            let key = m
                .key
                .as_ref()
                .map(|k| String::from_utf8_lossy(k).into_owned());
            (tid, py, tp, key)
        })
        .collect();
    assert_eq!(seen.len(), n, "{seen:?}");
    let spans: Vec<&str> = published
        .iter()
        .map(|l| l.split(' ').nth(2).unwrap())
        .collect();
    for (i, (tid, py, tp, key)) in seen.iter().enumerate() {
        assert_eq!(key.as_deref(), Some(format!("py-key-{i}").as_str()), "key");
        assert_eq!(tid, &trace_id, "handler {i} ran in another trace");
        assert_eq!(py.as_deref(), Some(format!("value-{i}").as_str()));
        assert_eq!(
            tp.as_deref(),
            Some(format!("00-{trace_id}-{}-01", spans[i]).as_str())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onceflow_messages_reach_pulsar_client() {
    let Some(url) = url("onceflow_messages_reach_pulsar_client") else {
        return;
    };
    let client = Client::new(onceflow_pulsar::connect(&onceflow_url(&url)).await.unwrap());
    let t = topic(&client).await;
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let n = 3;
    let ts = 1_700_000_000_000i64;
    for i in 0..n {
        let mut r = Record::new(t.clone(), format!("of-{i}"));
        r.timestamp = Some(ts + i as i64);
        producer
            .send(
                r.key(format!("key-{i}"))
                    .idempotency_key(format!("of-{i}"))
                    .header("X-Tenant-ID", format!("Tenant-{i}").into_bytes())
                    .header("content-type", b"application/json".to_vec())
                    .header(
                        "traceparent",
                        format!("00-{trace_id}-b7ad6b7169203331-01").into_bytes(),
                    ),
            )
            .await
            .unwrap();
    }
    let out = run_py(
        ENV,
        "pulsar_read_properties.py",
        &[&service_url(&url), &t, &n.to_string()],
    );
    struct Seen {
        payload: String,
        key: String,
        event_time: String,
        props: BTreeMap<String, String>,
    }
    let mut messages: Vec<Seen> = Vec::new();
    for line in out.lines() {
        if let Some(p) = line.strip_prefix("MSG ") {
            messages.push(Seen {
                payload: p.to_string(),
                key: String::new(),
                event_time: String::new(),
                props: BTreeMap::new(),
            });
        } else if let Some(k) = line.strip_prefix("KEY ") {
            messages.last_mut().unwrap().key = k.to_string();
        } else if let Some(e) = line.strip_prefix("EVENT_TIME ") {
            messages.last_mut().unwrap().event_time = e.to_string();
        } else if let Some(h) = line.strip_prefix("P ") {
            let (k, v) = h.split_once(": ").unwrap_or((h.trim_end_matches(':'), ""));
            messages
                .last_mut()
                .unwrap()
                .props
                .insert(k.to_string(), v.to_string());
        }
    }
    assert_eq!(messages.len(), n, "{out}");
    for (i, m) in messages.iter().enumerate() {
        let h = &m.props;
        assert_eq!(m.payload, format!("of-{i}"));
        assert_eq!(m.key, format!("key-{i}"), "partition key");
        assert_eq!(m.event_time, (ts + i as i64).to_string(), "event time");
        assert_eq!(
            h.get("X-Tenant-ID").map(String::as_str),
            Some(format!("Tenant-{i}").as_str()),
            "name case and value: {h:?}"
        );
        assert_eq!(
            h.get("content-type").map(String::as_str),
            Some("application/json")
        );
        assert_eq!(
            h.get("idempotency-key").map(String::as_str),
            Some(format!("of-{i}").as_str())
        );
        // The producer continues the trace it was given (a child span of the same trace).
        let tp = h.get("traceparent").expect("traceparent");
        assert!(tp.starts_with(&format!("00-{trace_id}-")), "{tp}");
    }
}

/// onceflow's Pulsar transactions (`transactions=true`, issue #27) as another client sees them:
/// pulsar-client reads what committed transactions sent, in order, and never what an aborted
/// one sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulsar_client_reads_committed_transactions_only() {
    let Some(url) = url("pulsar_client_reads_committed_transactions_only") else {
        return;
    };
    let client = Client::new(
        onceflow_pulsar::connect(&format!("{}&transactions=true", onceflow_url(&url)))
            .await
            .unwrap(),
    );
    let t = topic(&client).await;
    let producer = client
        .producer(ProducerConfig::new().transactional_id(name("interop-tx")))
        .await
        .unwrap();
    let mut tx = producer.begin().await.unwrap();
    for i in 0..3 {
        tx.send(Record::new(t.clone(), format!("c{i}")))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    for i in 0..3 {
        tx.send(Record::new(t.clone(), format!("x{i}")))
            .await
            .unwrap();
    }
    tx.abort().await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    tx.send(Record::new(t.clone(), "c3")).await.unwrap();
    tx.commit().await.unwrap();
    let plain = client.producer(ProducerConfig::new()).await.unwrap();
    plain.send(Record::new(t.clone(), "end")).await.unwrap();

    let out = run_py(
        ENV,
        "pulsar_read_properties.py",
        &[&service_url(&url), &t, "5"],
    );
    let payloads: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix("MSG ")).collect();
    assert_eq!(payloads, ["c0", "c1", "c2", "c3", "end"], "{out}");
}
