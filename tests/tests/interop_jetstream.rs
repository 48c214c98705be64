//! Interop with another NATS client, nats-py (PyPI), on the same real nats-server:
//!
//! - `nats_py_trace_continues_in_onceflow`: `tests/interop/nats_publish_traced.py` publishes to
//!   a stream's subject with a W3C `traceparent` per message (one trace); onceflow's idempotent
//!   consumer runs each handler inside that trace and sees nats-py's headers.
//! - `onceflow_headers_reach_nats_py`: records onceflow produces are read by
//!   `tests/interop/nats_read_headers.py` with their headers intact (names with their case,
//!   values, the injected `traceparent`, the key header).
//!
//! nats-py is installed once by `tests/interop/nats-env.sh` into
//! `~/.cache/onceflow/venv-nats-interop`. Runs when `ONCEFLOW_NATS_URL` is set; without it each
//! test says it skipped, and with `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) that is a failure.

use std::collections::BTreeMap;

use onceflow_conformance::interop::{handle_in_trace, run_py, unique_name as name, url_or_skip};
use onceflow_core::{Client, ConsumerConfig, ProducerConfig, Record, StartFrom, TopicSpec};

const ENV: &str = "nats-env.sh";

fn url(test: &str) -> Option<String> {
    url_or_skip("ONCEFLOW_NATS_URL", "nats", "interop_jetstream", test)
}

async fn topic(client: &Client) -> String {
    let t = name("interop");
    let mut spec = TopicSpec::new(t.clone(), 1);
    spec.options.insert("storage".into(), "memory".into());
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
async fn nats_py_trace_continues_in_onceflow() {
    let Some(url) = url("nats_py_trace_continues_in_onceflow") else {
        return;
    };
    let client = Client::new(onceflow_jetstream::connect(&url).await.unwrap());
    let t = topic(&client).await; // one partition: the subject is the topic
    let trace_id = format!("{:032x}", rand::random::<u128>() | 1);
    let n = 5;
    let published = run_py(
        ENV,
        "nats_publish_traced.py",
        &[&url, &t, &n.to_string(), &trace_id],
    );
    assert_eq!(published.lines().count(), n, "{published}");

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
            (tid, py, tp)
        })
        .collect();
    assert_eq!(seen.len(), n, "{seen:?}");
    let spans: Vec<&str> = published
        .lines()
        .map(|l| l.split(' ').nth(2).unwrap())
        .collect();
    for (i, (tid, py, tp)) in seen.iter().enumerate() {
        assert_eq!(tid, &trace_id, "handler {i} ran in another trace");
        assert_eq!(py.as_deref(), Some(format!("value-{i}").as_str()));
        assert_eq!(
            tp.as_deref(),
            Some(format!("00-{trace_id}-{}-01", spans[i]).as_str())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onceflow_headers_reach_nats_py() {
    let Some(url) = url("onceflow_headers_reach_nats_py") else {
        return;
    };
    let client = Client::new(onceflow_jetstream::connect(&url).await.unwrap());
    let t = topic(&client).await;
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let n = 3;
    for i in 0..n {
        producer
            .send(
                Record::new(t.clone(), format!("of-{i}"))
                    .key(format!("key-{i}"))
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
    let out = run_py(ENV, "nats_read_headers.py", &[&url, &t, &t, &n.to_string()]);
    let mut messages: Vec<(String, BTreeMap<String, String>)> = Vec::new();
    for line in out.lines() {
        if let Some(rest) = line.strip_prefix("MSG ") {
            let payload = rest.split_once(' ').unwrap().1.to_string();
            messages.push((payload, BTreeMap::new()));
        } else if let Some(h) = line.strip_prefix("H ") {
            let (k, v) = h.split_once(": ").unwrap_or((h.trim_end_matches(':'), ""));
            messages
                .last_mut()
                .unwrap()
                .1
                .insert(k.to_string(), v.to_string());
        }
    }
    assert_eq!(messages.len(), n, "{out}");
    for (i, (payload, h)) in messages.iter().enumerate() {
        assert_eq!(payload, &format!("of-{i}"));
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
            h.get("Nats-Msg-Id").map(String::as_str),
            Some(format!("of-{i}").as_str())
        );
        assert_eq!(
            h.get("onceflow-key").map(String::as_str),
            Some(format!("key-{i}").as_str())
        );
        // The producer continues the trace it was given (a child span of the same trace).
        let tp = h.get("traceparent").expect("traceparent");
        assert!(tp.starts_with(&format!("00-{trace_id}-")), "{tp}");
    }
}
