//! Resends are reported: where onceflow sends a record again, its `Delivery::attempts` says how
//! many times it was sent, and each resend is counted in `onceflow.send_retries` (the
//! OpenTelemetry counter, attribute `messaging.system`, and `metrics::send_retries`). On real
//! brokers behind a fault layer:
//!
//! - JetStream: the first publish ack of a record is lost on its way back (the NATS fault proxy
//!   drops it), so the publish times out and is published again with the same `Nats-Msg-Id`;
//!   the stream holds the record once.
//! - Kinesis (kinesis-local, which never throttles on its own, behind `kinesis_throttle`): one
//!   entry of a PutRecords call fails as throttled and is put again; a whole PutRecords call is
//!   throttled and the AWS SDK retries it itself. Every record is stored once.
//!
//! Plain sends take one attempt on every platform: the backend suite's
//! `plain_sends_take_one_attempt`. Runs when `ONCEFLOW_NATS_URL` / `ONCEFLOW_KINESIS_URL` are
//! set; without them each test says it skipped, and with `ONCEFLOW_REQUIRE_BROKERS=1` (set by
//! `make test`) a missing broker fails the run. The two tests are alone in this binary, so the
//! process totals per platform count only their resends.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use onceflow_conformance::fault_proxy::{nats_payload, Action, Direction, FaultProxy};
use onceflow_conformance::harness::{broker_url, Harness, PlatformHarness, Timings};
use onceflow_conformance::kinesis_throttle::ThrottleProxy;
use onceflow_core::metrics::{send_retries, SEND_RETRIES};
use onceflow_core::{
    Client, ConsumerConfig, Delivery, PlatformBackend, ProducerConfig, Record, StartFrom,
};
use opentelemetry::global;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use tokio::time::Instant;

struct Telemetry {
    metrics: InMemoryMetricExporter,
    meters: SdkMeterProvider,
}

/// The global meter provider, installed once for the binary, before any producer is made (a
/// producer's counter is the provider's it found when it was made).
fn telemetry() -> &'static Telemetry {
    static T: OnceLock<Telemetry> = OnceLock::new();
    T.get_or_init(|| {
        let metrics = InMemoryMetricExporter::default();
        let meters = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(metrics.clone()).build())
            .build();
        global::set_meter_provider(meters.clone());
        Telemetry { metrics, meters }
    })
}

/// The value of the `onceflow.send_retries` counter for `system`, as the SDK exported it last
/// (0 before any point).
fn exported_retries(system: &str) -> u64 {
    let t = telemetry();
    t.meters.force_flush().unwrap();
    let mut found = 0;
    for rm in t.metrics.get_finished_metrics().unwrap() {
        for sm in rm.scope_metrics() {
            for m in sm.metrics().filter(|m| m.name() == SEND_RETRIES) {
                if let AggregatedMetrics::U64(MetricData::Sum(sum)) = m.data() {
                    for p in sum.data_points() {
                        if p.attributes().any(|kv| {
                            kv.key.as_str() == "messaging.system" && kv.value.as_str() == system
                        }) {
                            found = p.value();
                        }
                    }
                }
            }
        }
    }
    found
}

/// Both readings of the counter for `system`: the process total and the exported one.
fn retries_of(system: &str) -> (u64, u64) {
    (send_retries(system), exported_retries(system))
}

/// The broker URL in `var`, with the meter provider installed; `None` after saying the test
/// is skipped.
fn broker(var: &str, service: &str, test: &str) -> Option<String> {
    match broker_url(var, service) {
        Ok(url) => {
            telemetry();
            Some(url)
        }
        Err(reason) => {
            eprintln!("{test}: SKIPPED: {reason}");
            None
        }
    }
}

/// A new one-partition topic on `platform`, once the platform describes it.
async fn new_topic(platform: Arc<dyn PlatformBackend>) -> String {
    PlatformHarness::new(platform, Timings::broker())
        .topic(1)
        .await
        .unwrap()
}

/// `host:port` of a broker URL.
fn host_port(url: &str) -> String {
    let u = url::Url::parse(url).unwrap_or_else(|e| panic!("'{url}': {e}"));
    format!(
        "{}:{}",
        u.host_str().expect("a host"),
        u.port().expect("a port")
    )
}

/// Reads `topic` from the start until `n` messages came, then for another second; returns
/// every payload read.
async fn stored(platform: Arc<dyn PlatformBackend>, topic: &str, n: usize) -> Vec<String> {
    let config = ConsumerConfig::new(format!("retries-{}", rand::random::<u32>()), [topic])
        .start(StartFrom::Earliest);
    let consumer = platform.consumer(config).await.unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut quiet_until = None;
    loop {
        for m in consumer
            .poll(100, Duration::from_millis(250))
            .await
            .unwrap()
        {
            got.push(String::from_utf8_lossy(&m.payload).into_owned());
        }
        let now = Instant::now();
        if got.len() >= n && quiet_until.is_none() {
            quiet_until = Some(now + Duration::from_secs(1));
        }
        if quiet_until.is_some_and(|q| now >= q) || now >= deadline {
            break;
        }
    }
    consumer.close().await.unwrap();
    got.sort();
    got
}

fn attempts(ds: &[Delivery]) -> Vec<u32> {
    ds.iter().map(|d| d.attempts).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_publish_whose_ack_is_lost_is_sent_again_and_stored_once() {
    let test = "jetstream_a_publish_whose_ack_is_lost_is_sent_again_and_stored_once";
    let Some(url) = broker("ONCEFLOW_NATS_URL", "nats", test) else {
        return;
    };
    let direct = onceflow_jetstream::connect(&format!("nats://{}?storage=memory", host_port(&url)))
        .await
        .unwrap();
    let topic = new_topic(direct.clone()).await;
    let proxy = FaultProxy::start_nats("127.0.0.1:0", &host_port(&url))
        .await
        .unwrap();
    let behind = onceflow_jetstream::connect(&format!("nats://{}?storage=memory", proxy.addr()))
        .await
        .unwrap();
    // Long enough that only the dropped ack times out on a loaded machine, short enough to be
    // quick: the resend comes 2 s after the first publish.
    let producer = Client::new(behind)
        .producer(ProducerConfig::new().option("publish_timeout_ms", "2000"))
        .await
        .unwrap();
    // The topic's stream is looked up on its first send: an ack that comes back at once.
    let first = producer.send(Record::new(&topic, "first")).await.unwrap();
    assert_eq!(first.attempts, 1, "{first:?}");
    let before = retries_of("jetstream");

    // The next publish ack (`{"stream":…,"seq":…}`) is lost.
    proxy.once(
        Direction::ToClient,
        |f| nats_payload(f).is_some_and(|p| p.starts_with(br#"{"stream":"#)),
        Action::Drop,
    );
    let d = producer
        .send(Record::new(&topic, "acked on the second publish"))
        .await
        .unwrap();
    assert_eq!(proxy.fired(), 1, "the first publish's ack was dropped");
    assert_eq!(d.attempts, 2, "{d:?}");
    assert!(
        !d.duplicate,
        "our own earlier publish, not someone else's record: {d:?}"
    );
    let after = retries_of("jetstream");
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (1, 1),
        "one resend in the process total and in the exported {SEND_RETRIES}"
    );
    assert_eq!(
        stored(direct, &topic, 2).await,
        ["acked on the second publish", "first"],
        "the stream holds the resent record once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinesis_throttled_puts_are_sent_again_and_stored_once() {
    let test = "kinesis_throttled_puts_are_sent_again_and_stored_once";
    let Some(url) = broker("ONCEFLOW_KINESIS_URL", "kinesis", test) else {
        return;
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    let direct = onceflow_kinesis::connect(&format!("{url}{sep}idle_ms=100"))
        .await
        .unwrap();
    let topic = new_topic(direct.clone()).await;
    let proxy = ThrottleProxy::start(&host_port(&url)).await.unwrap();
    let behind =
        onceflow_kinesis::connect(&url.replace(&host_port(&url), &proxy.addr().to_string()))
            .await
            .unwrap();
    let producer = Client::new(behind)
        .producer(ProducerConfig::new())
        .await
        .unwrap();
    let record = |key: &str| Record::new(&topic, key.to_string()).key(key.to_string());
    let before = retries_of("kinesis");

    // A partial failure: of one PutRecords call, the entry keyed "b" is throttled once and put
    // again; the others are written at once.
    proxy.throttle_entries("b", 1);
    let ds: Vec<Delivery> = producer
        .send_batch(vec![record("a"), record("b"), record("c")])
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(attempts(&ds), [1, 2, 1], "{ds:?}");
    let after = retries_of("kinesis");
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 1));

    // A throttled call: the AWS SDK retries the whole call itself; its second request counts.
    proxy.throttle_calls(1);
    let d = producer.send(record("d")).await.unwrap();
    assert_eq!(d.attempts, 2, "{d:?}");
    let after = retries_of("kinesis");
    assert_eq!((after.0 - before.0, after.1 - before.1), (2, 2));
    assert_eq!(
        proxy.throttled(),
        2,
        "one entry and one call were throttled"
    );

    assert_eq!(
        stored(direct, &topic, 4).await,
        ["a", "b", "c", "d"],
        "every record is stored once"
    );
}
