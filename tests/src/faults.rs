//! Shared pieces of the fault tests on broker clusters (`tests/faults_*.rs`, issue #28): the
//! clusters' node scripts (`tests/brokers/{kafka,nats}-cluster/node.sh`, which SIGKILL and
//! restart one node), the tally of an output against its inputs and the `FAULTS` line every
//! fault test prints, and two Kafka requests (Metadata, FindCoordinator) that name the broker
//! to kill.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `ONCEFLOW_SOAK_MINUTES`: minutes a soak variant runs (0 or unset: the short run only).
pub fn soak_minutes() -> u64 {
    std::env::var("ONCEFLOW_SOAK_MINUTES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// One node script of a cluster (`node.sh kill|start|restart N`).
#[derive(Debug, Clone)]
pub struct ClusterNodes {
    script: PathBuf,
}

impl ClusterNodes {
    /// The script named by `var` (printed by the cluster's up.sh), or else the one in this
    /// checkout under `tests/brokers/<cluster>/node.sh`.
    pub fn new(var: &str, cluster: &str) -> ClusterNodes {
        let script = std::env::var(var).map(PathBuf::from).unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("brokers")
                .join(cluster)
                .join("node.sh")
        });
        ClusterNodes { script }
    }

    async fn run(&self, cmd: &'static str, node: u32) {
        let script = self.script.clone();
        let out = tokio::task::spawn_blocking(move || {
            std::process::Command::new("bash")
                .arg(&script)
                .arg(cmd)
                .arg(node.to_string())
                .output()
        })
        .await
        .expect("node.sh task")
        .expect("node.sh runs");
        assert!(
            out.status.success(),
            "node.sh {cmd} {node} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// SIGKILLs node `node` (1..3); returns once it is gone.
    pub async fn kill(&self, node: u32) {
        self.run("kill", node).await;
    }

    /// Starts node `node` again on its data; returns once it answers.
    pub async fn start(&self, node: u32) {
        self.run("start", node).await;
    }

    /// What `node.sh state N` prints for each node 1..3 (running or not, health, the last
    /// lines of its log about leaders), for the message of a test that fails waiting on the
    /// cluster. A script without a `state` command gives its error instead.
    pub async fn describe(&self) -> String {
        let script = self.script.clone();
        tokio::task::spawn_blocking(move || {
            (1..=3)
                .map(|n| {
                    match std::process::Command::new("bash")
                        .arg(&script)
                        .arg("state")
                        .arg(n.to_string())
                        .output()
                    {
                        Ok(out) => format!(
                            "{}{}",
                            String::from_utf8_lossy(&out.stdout),
                            String::from_utf8_lossy(&out.stderr)
                        ),
                        Err(e) => format!("node {n}: node.sh state failed: {e}\n"),
                    }
                })
                .collect::<String>()
        })
        .await
        .unwrap_or_else(|e| format!("node.sh state task: {e}"))
    }
}

/// Inputs missing from an output and inputs in it more than once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tally {
    /// Expected keys not seen.
    pub lost: usize,
    /// Extra copies: the sum over the keys of (times seen - 1).
    pub duplicated: usize,
}

impl Tally {
    /// Tallies `seen` (key → times seen) against the `expected` keys. A key seen that was not
    /// expected counts as a duplicate (something was written that no input asked for).
    pub fn of<'a>(
        expected: impl IntoIterator<Item = &'a String>,
        seen: &BTreeMap<String, usize>,
    ) -> Tally {
        let mut t = Tally::default();
        let mut expected_n = 0;
        for k in expected {
            expected_n += 1;
            match seen.get(k) {
                None | Some(0) => t.lost += 1,
                Some(n) => t.duplicated += n - 1,
            }
        }
        let total: usize = seen.values().sum();
        let matched: usize = expected_n - t.lost + t.duplicated;
        t.duplicated += total - matched.min(total);
        t
    }

    /// Both tallies together.
    pub fn plus(self, other: Tally) -> Tally {
        Tally {
            lost: self.lost + other.lost,
            duplicated: self.duplicated + other.duplicated,
        }
    }
}

/// Prints the line `FAULTS <test> injected=N lost=L duplicated=D` (what a reader greps for),
/// and appends it to the file `ONCEFLOW_FAULTS_FILE` names, if set: the test harness keeps a
/// passing test's output to itself, so `tests/run-all.sh` collects the lines there and prints
/// them after the Rust tests.
pub fn report(test: &str, injected: usize, t: Tally) {
    let line = format!(
        "FAULTS {test} injected={injected} lost={} duplicated={}",
        t.lost, t.duplicated
    );
    println!("{line}");
    if let Some(path) = std::env::var_os("ONCEFLOW_FAULTS_FILE") {
        use std::io::Write as _;
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = appended {
            eprintln!("cannot append to {}: {e}", path.to_string_lossy());
        }
    }
}

/// Kafka's FindCoordinator key types.
#[derive(Debug, Clone, Copy)]
pub enum CoordinatorType {
    /// A consumer group's coordinator.
    Group = 0,
    /// A transactional id's coordinator.
    Transaction = 1,
}

/// One request/response round trip of Kafka's wire protocol (non-flexible versions) to
/// `addr`; returns the response body after the correlation id.
async fn kafka_request(addr: &str, api_key: i16, version: i16, body: &[u8]) -> Vec<u8> {
    let mut req = Vec::new();
    req.extend_from_slice(&api_key.to_be_bytes());
    req.extend_from_slice(&version.to_be_bytes());
    req.extend_from_slice(&7i32.to_be_bytes()); // correlation id
    let client_id = b"onceflow-faults";
    req.extend_from_slice(&(client_id.len() as i16).to_be_bytes());
    req.extend_from_slice(client_id);
    req.extend_from_slice(body);
    let mut s = TcpStream::connect(addr)
        .await
        .expect("connect to a Kafka broker");
    s.write_all(&(req.len() as i32).to_be_bytes())
        .await
        .unwrap();
    s.write_all(&req).await.unwrap();
    let len = s.read_i32().await.expect("Kafka response length") as usize;
    let mut resp = vec![0; len];
    s.read_exact(&mut resp).await.expect("Kafka response");
    assert_eq!(&resp[..4], &7i32.to_be_bytes(), "correlation id");
    resp.split_off(4)
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn i16(&mut self) -> i16 {
        let v = i16::from_be_bytes(self.0[..2].try_into().unwrap());
        self.0 = &self.0[2..];
        v
    }
    fn i32(&mut self) -> i32 {
        let v = i32::from_be_bytes(self.0[..4].try_into().unwrap());
        self.0 = &self.0[4..];
        v
    }
    fn string(&mut self) -> Option<String> {
        let n = self.i16();
        if n < 0 {
            return None;
        }
        let s = String::from_utf8_lossy(&self.0[..n as usize]).into_owned();
        self.0 = &self.0[n as usize..];
        Some(s)
    }
    fn skip(&mut self, n: usize) {
        self.0 = &self.0[n..];
    }
}

fn kafka_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as i16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The node id of the coordinator of `key` (FindCoordinator v1), asked of the brokers in
/// `bootstrap` (`host:port,…`) in turn until one answers without error; retried for up to 60 s
/// (a coordinator moving after a kill answers COORDINATOR_NOT_AVAILABLE for a while).
pub async fn find_coordinator(bootstrap: &str, key: &str, kind: CoordinatorType) -> i32 {
    let mut body = Vec::new();
    kafka_string(&mut body, key);
    body.push(kind as u8);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        for addr in bootstrap.split(',') {
            let Ok(Ok(resp)) = tokio::time::timeout(
                Duration::from_secs(5),
                tokio::spawn(kafka_request_owned(addr.to_string(), 10, 1, body.clone())),
            )
            .await
            else {
                continue;
            };
            let mut r = Reader(&resp);
            r.skip(4); // throttle_time_ms
            let error = r.i16();
            let _message = r.string();
            let node = r.i32();
            if error == 0 {
                return node;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no broker names the coordinator of {key}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn kafka_request_owned(addr: String, api_key: i16, version: i16, body: Vec<u8>) -> Vec<u8> {
    kafka_request(&addr, api_key, version, &body).await
}

/// The node id leading `partition` of `topic` (Metadata v4: Kafka 4 removed v0-v3, KIP-896),
/// asked as [`find_coordinator`].
pub async fn partition_leader(bootstrap: &str, topic: &str, partition: i32) -> i32 {
    let mut body = Vec::new();
    body.extend_from_slice(&1i32.to_be_bytes());
    kafka_string(&mut body, topic);
    body.push(0); // allow_auto_topic_creation: false
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        for addr in bootstrap.split(',') {
            let Ok(Ok(resp)) = tokio::time::timeout(
                Duration::from_secs(5),
                tokio::spawn(kafka_request_owned(addr.to_string(), 3, 4, body.clone())),
            )
            .await
            else {
                continue;
            };
            if let Some(leader) = leader_in_metadata(&resp, partition) {
                return leader;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no broker names the leader of {topic}-{partition}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits (up to 120 s) until every partition of `topics` has a leader and `replicas` in-sync
/// replicas (Metadata v4), e.g. after a killed broker came back and caught up.
pub async fn wait_fully_replicated(bootstrap: &str, topics: &[&str], replicas: usize) {
    let mut body = Vec::new();
    body.extend_from_slice(&(topics.len() as i32).to_be_bytes());
    for t in topics {
        kafka_string(&mut body, t);
    }
    body.push(0); // allow_auto_topic_creation: false
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut last = String::new();
    loop {
        for addr in bootstrap.split(',') {
            let Ok(Ok(resp)) = tokio::time::timeout(
                Duration::from_secs(5),
                tokio::spawn(kafka_request_owned(addr.to_string(), 3, 4, body.clone())),
            )
            .await
            else {
                continue;
            };
            let parts = partitions_in_metadata(&resp);
            let short: Vec<_> = parts
                .iter()
                .filter(|p| p.error != 0 || p.leader < 0 || p.isr < replicas)
                .collect();
            if !parts.is_empty() && short.is_empty() {
                return;
            }
            last = short
                .iter()
                .map(|p| {
                    format!(
                        "{}-{}: leader {} isr {} error {}",
                        p.topic, p.index, p.leader, p.isr, p.error
                    )
                })
                .collect::<Vec<_>>()
                .join(", ");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "partitions of {topics:?} not fully replicated within 120 s: {last}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// One partition of a Metadata response.
#[derive(Clone)]
struct PartitionMeta {
    topic: String,
    error: i16,
    index: i32,
    leader: i32,
    isr: usize,
}

/// The partitions of a Metadata v4 response (a topic's own error as its partitions' error).
fn partitions_in_metadata(resp: &[u8]) -> Vec<PartitionMeta> {
    let mut r = Reader(resp);
    r.i32(); // throttle_time_ms
    let brokers = r.i32();
    for _ in 0..brokers {
        r.i32(); // node id
        r.string(); // host
        r.i32(); // port
        r.string(); // rack
    }
    r.string(); // cluster id
    r.i32(); // controller id
    let mut out = Vec::new();
    let topics = r.i32();
    for _ in 0..topics {
        let topic_error = r.i16();
        let topic = r.string().unwrap_or_default();
        r.skip(1); // is_internal
        let partitions = r.i32();
        if topic_error != 0 {
            out.push(PartitionMeta {
                topic: topic.clone(),
                error: topic_error,
                index: -1,
                leader: -1,
                isr: 0,
            });
        }
        for _ in 0..partitions {
            let error = r.i16();
            let index = r.i32();
            let leader = r.i32();
            let replicas = r.i32();
            r.skip(4 * replicas.max(0) as usize);
            let isr = r.i32();
            r.skip(4 * isr.max(0) as usize);
            out.push(PartitionMeta {
                topic: topic.clone(),
                error,
                index,
                leader,
                isr: isr.max(0) as usize,
            });
        }
    }
    out
}

/// The leader of `partition` of the one topic of a Metadata v4 response, if it has one.
fn leader_in_metadata(resp: &[u8], partition: i32) -> Option<i32> {
    partitions_in_metadata(resp)
        .into_iter()
        .find(|p| p.error == 0 && p.index == partition && p.leader >= 0)
        .map(|p| p.leader)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_counts_missing_and_extra_copies() {
        let expected: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
        let seen: BTreeMap<String, usize> = [("k0", 1), ("k1", 2), ("k3", 1), ("stray", 1)]
            .into_iter()
            .map(|(k, n)| (k.to_string(), n))
            .collect();
        assert_eq!(
            Tally::of(&expected, &seen),
            Tally {
                lost: 1,
                duplicated: 2
            }
        );
    }
}
