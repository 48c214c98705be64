//! The backend conformance suite on a real Apache Kafka broker. Runs when `ONCEFLOW_KAFKA_URL`
//! is set (`set -a; eval "$(tests/brokers/up.sh kafka)"; set +a`); without it every case is
//! reported as skipped with that reason, never passed silently.

use onceflow_conformance::harness::{PlatformHarness, Timings};

const URL_VAR: &str = "ONCEFLOW_KAFKA_URL";

fn kafka() -> PlatformHarness {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => {
            let platform = onceflow_kafka::connect(&url)
                .unwrap_or_else(|e| panic!("{URL_VAR}='{url}' is not a Kafka URL: {e}"));
            PlatformHarness::new(platform, Timings::broker())
        }
        _ => {
            // Nothing is contacted until a case runs, and none does.
            let platform = onceflow_kafka::connect("kafka://127.0.0.1:9").expect("static URL");
            PlatformHarness::new(platform, Timings::broker()).skip_all(format!(
                "{URL_VAR} is not set: start a broker with tests/brokers/up.sh kafka"
            ))
        }
    }
}

onceflow_conformance::backend_suite!(kafka());
