//! Interop with AWS's own Python SDK, boto3 (PyPI), on the same Kinesis-compatible server:
//!
//! - `boto3_plain_json_is_consumed`: records put by boto3 (plain JSON, no envelope) are read by
//!   onceflow's consumer as plain payloads: the partition key as key, no headers, the arrival
//!   time as timestamp.
//! - `onceflow_envelope_is_read_by_boto3`: records onceflow produces (headers, a timestamp) are
//!   read by boto3 and decoded by the Python envelope decoder (`tests/interop/kinesis_envelope.py`):
//!   headers, timestamp, payload and partition key intact.
//!
//! boto3 is installed once by `tests/interop/kinesis-env.sh` into
//! `~/.cache/onceflow/venv-kinesis-interop`. Runs when `ONCEFLOW_KINESIS_URL` is set; without it
//! each test says it skipped, and with `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) that fails.

use std::time::Duration;

use onceflow_conformance::interop::{run_py, url_or_skip};
use onceflow_core::{Client, ConsumerConfig, ProducerConfig, Record, StartFrom, TopicSpec};

fn url(test: &str) -> Option<String> {
    url_or_skip("ONCEFLOW_KINESIS_URL", "kinesis", "interop_kinesis", test)
}

/// `http://host:port` and the region of a `kinesis://host:port?region=…` URL.
fn endpoint(url: &str) -> (String, String) {
    let opts = onceflow_kinesis::parse_url(url).unwrap();
    (
        opts.endpoint.expect("a local endpoint"),
        opts.region.unwrap_or_else(|| "us-east-1".into()),
    )
}

fn boto3(args: &[&str]) -> String {
    run_py("kinesis-env.sh", "kinesis_boto3.py", args)
}

async fn stream(client: &Client) -> String {
    let s = format!("interop-{:016x}", rand::random::<u64>());
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(s.clone(), 2))
        .await
        .unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boto3_plain_json_is_consumed() {
    let Some(url) = url("boto3_plain_json_is_consumed") else {
        return;
    };
    let client = Client::new(onceflow_kinesis::connect(&url).await.unwrap());
    let s = stream(&client).await;
    let (ep, region) = endpoint(&url);
    let n = 9;
    let seqs = boto3(&["put", &ep, &region, &s, &n.to_string()]);
    assert_eq!(seqs.lines().count(), n);
    let consumer = client
        .consumer(ConsumerConfig::new("interop", [s.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while got.len() < n && tokio::time::Instant::now() < deadline {
        got.extend(
            consumer
                .poll(100, Duration::from_millis(250))
                .await
                .unwrap(),
        );
    }
    assert_eq!(got.len(), n, "boto3's records consumed");
    let mut orders = Vec::new();
    for m in &got {
        let v: serde_json::Value = serde_json::from_slice(&m.payload).expect("plain JSON payload");
        assert_eq!(v["source"], "boto3");
        let i = v["order"].as_u64().unwrap();
        assert_eq!(
            m.key.as_deref(),
            Some(format!("user-{}", i % 3).as_bytes()),
            "key = partition key"
        );
        assert!(m.headers.is_empty(), "plain records have no headers");
        assert!(m.timestamp.is_some(), "arrival time as timestamp");
        assert!(seqs
            .lines()
            .any(|l| m.position.to_string() == format!("kinesis:{l}")));
        orders.push(i);
    }
    orders.sort();
    assert_eq!(orders, (0..n as u64).collect::<Vec<_>>());
    let _ = client.admin().await.unwrap().delete_topic(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onceflow_envelope_is_read_by_boto3() {
    let Some(url) = url("onceflow_envelope_is_read_by_boto3") else {
        return;
    };
    let client = Client::new(onceflow_kinesis::connect(&url).await.unwrap());
    let s = stream(&client).await;
    let p = client.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..4 {
        let mut r = Record::new(s.clone(), format!("{{\"n\":{i}}}"))
            .key(format!("k{i}"))
            .header("x-app", format!("v{i}"))
            .idempotency_key(format!("idem-{i}"));
        r.timestamp = Some(1_700_000_000_000 + i);
        p.send(r).await.unwrap();
    }
    let (ep, region) = endpoint(&url);
    let lines = boto3(&["read", &ep, &region, &s, "4"]);
    let recs: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 4, "{lines}");
    for r in recs {
        assert_eq!(r["enveloped"], true);
        let n: serde_json::Value = serde_json::from_str(r["payload"].as_str().unwrap()).unwrap();
        let i = n["n"].as_i64().unwrap();
        assert_eq!(r["partition_key"], format!("k{i}"));
        assert_eq!(r["headers"]["x-app"], format!("v{i}"));
        assert_eq!(r["headers"]["idempotency-key"], format!("idem-{i}"));
        assert_eq!(r["timestamp"], 1_700_000_000_000 + i);
    }
    let _ = client.admin().await.unwrap().delete_topic(&s).await;
}
