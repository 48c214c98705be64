//! Crash test on a real nats-server: the idempotent pipeline runs in a child process (this test
//! binary, re-run with `ONCEFLOW_CRASH_CHILD` set, entering [`crash_child`]) that is SIGKILLed
//! at random points, at least 20 times (`ONCEFLOW_CRASH_KILLS` for more), then runs to the end.
//! Afterwards the output stream holds every input exactly once (by `Nats-Msg-Id`), and the side
//! effect of every input, applied through the embedded dedup store shared by all the runs, is
//! recorded exactly once.
//!
//! Runs when `ONCEFLOW_NATS_URL` is set (`tests/brokers/up.sh nats`); `ONCEFLOW_REQUIRE_BROKERS=1`
//! (set by `make test`) turns a missing server into a failure.

use std::collections::HashMap;

use onceflow_conformance::crash::{
    check_side_effects, kill_and_finish, run_child, CrashSpec, INPUTS,
};
use onceflow_conformance::interop::url_or_skip;
use onceflow_core::Client;

fn url() -> Option<String> {
    url_or_skip(
        "ONCEFLOW_NATS_URL",
        "nats",
        "crash_pipeline",
        "the crash test",
    )
}

/// The child: runs the pipeline until the group has committed every input, then exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_child() {
    let Some(spec) = CrashSpec::from_env() else {
        return; // Only a child started by `pipeline_survives_sigkill_at_random_points` runs.
    };
    let client = Client::new(
        onceflow_jetstream::connect(&spec.url)
            .await
            .expect("connect"),
    );
    run_child(&spec, client, &[("ack_wait_ms", "1000")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_survives_sigkill_at_random_points() {
    let Some(url) = url() else { return };
    let platform = onceflow_jetstream::connect(&url).await.unwrap();
    let client = Client::new(platform.clone());
    let spec = CrashSpec::new(&url);
    let output = spec.output.clone();
    kill_and_finish(&spec, &client, |s| {
        s.options.insert("storage".into(), "memory".into());
    })
    .await;

    // The output stream: every input exactly once, by Nats-Msg-Id `{input key}:0`.
    let js = async_nats::jetstream::new(platform.nats_client());
    let mut stream = js.get_stream(&output).await.unwrap();
    let info = stream.info().await.unwrap().clone();
    let mut ids: HashMap<String, u32> = HashMap::new();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        let m = stream.get_raw_message(seq).await.unwrap();
        let id = m
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .map(|v| v.as_str().to_string())
            .expect("every output has a Nats-Msg-Id");
        *ids.entry(id).or_default() += 1;
    }
    let repeated: Vec<_> = ids.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "outputs written twice: {repeated:?}");
    for i in 0..INPUTS {
        assert_eq!(ids.get(&format!("in-{i}:0")), Some(&1), "output of in-{i}");
    }
    assert_eq!(info.state.messages as usize, INPUTS, "no other outputs");

    check_side_effects(&spec.store_path).await;
    spec.clean_up(&client).await;
}
