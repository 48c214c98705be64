//! Throttling in front of a real Kinesis-compatible server on loopback. kinesis-local stores
//! every record it is given (it enforces no shard write limit), so this HTTP/1.1 relay answers
//! for it as AWS answers a producer over a shard's limit (Kinesis API Reference, PutRecords):
//!
//! - [`ThrottleProxy::throttle_entries`]: entries of a PutRecords call with a given partition
//!   key are taken out of the request before it reaches the server (so they are not written)
//!   and reported failed at their index in its answer, `ErrorCode`
//!   `ProvisionedThroughputExceededException`, with `FailedRecordCount` raised to match: a
//!   partial failure.
//! - [`ThrottleProxy::throttle_calls`]: whole PutRecords calls are answered with HTTP 400
//!   `ProvisionedThroughputExceededException` without reaching the server.
//!
//! Every other request, and the rest of a PutRecords call, reaches the server unchanged; its
//! answers come back unchanged but for the failed entries put in. Each client connection gets
//! its own server connection, one request at a time (HTTP/1.1 keep-alive, `Content-Length`
//! bodies, as the AWS SDKs send them).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const PUT_RECORDS: &str = "Kinesis_20131202.PutRecords";
const THROTTLED: &str = "ProvisionedThroughputExceededException";

#[derive(Default)]
struct Rules {
    /// Partition keys whose next entries fail, and how many more of each.
    entries: Vec<(String, usize)>,
    /// How many more PutRecords calls fail whole.
    calls: usize,
}

struct Inner {
    upstream: String,
    rules: Mutex<Rules>,
    throttled: AtomicUsize,
}

/// A running throttling relay; stops accepting connections when dropped.
pub struct ThrottleProxy {
    addr: std::net::SocketAddr,
    inner: Arc<Inner>,
    accept: JoinHandle<()>,
}

impl ThrottleProxy {
    /// Listens on a free loopback port and relays to `upstream` (`host:port` of the server's
    /// plain HTTP listener).
    pub async fn start(upstream: &str) -> std::io::Result<ThrottleProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            upstream: upstream.to_string(),
            rules: Mutex::new(Rules::default()),
            throttled: AtomicUsize::new(0),
        });
        let accept = tokio::spawn({
            let inner = inner.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    tokio::spawn(serve(inner.clone(), client));
                }
            }
        });
        Ok(ThrottleProxy {
            addr,
            inner,
            accept,
        })
    }

    /// The `host:port` clients connect to (`kinesis://{addr}?region=…`).
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The next `times` PutRecords entries with partition key `partition_key` fail as
    /// throttled (not written; reported failed in the call's answer).
    pub fn throttle_entries(&self, partition_key: &str, times: usize) {
        let mut rules = self.inner.rules.lock().unwrap();
        rules.entries.push((partition_key.to_string(), times));
    }

    /// The next `times` PutRecords calls fail whole as throttled (HTTP 400).
    pub fn throttle_calls(&self, times: usize) {
        self.inner.rules.lock().unwrap().calls += times;
    }

    /// How many entries and calls were throttled so far.
    pub fn throttled(&self) -> usize {
        self.inner.throttled.load(Ordering::Relaxed)
    }
}

impl Drop for ThrottleProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// One HTTP message: its head (start line and headers, without the blank line) and its body.
struct Http {
    head: String,
    body: Vec<u8>,
}

impl Http {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    /// The message on the wire, with `Content-Length` set to its body's length.
    fn to_wire(&self) -> Vec<u8> {
        let mut out = String::new();
        for (i, line) in self.head.lines().enumerate() {
            let is_length = line
                .split_once(':')
                .is_some_and(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"));
            if i > 0 && is_length {
                continue;
            }
            out.push_str(line);
            out.push_str("\r\n");
        }
        out.push_str(&format!("Content-Length: {}\r\n\r\n", self.body.len()));
        let mut wire = out.into_bytes();
        wire.extend_from_slice(&self.body);
        wire
    }
}

/// Reads one message: the head up to the blank line, then `Content-Length` bytes of body.
/// `None` when the peer closed the connection between messages.
async fn read_http<R: AsyncRead + Unpin>(from: &mut BufReader<R>) -> std::io::Result<Option<Http>> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if from.read_line(&mut line).await? == 0 {
            return if head.is_empty() {
                Ok(None)
            } else {
                Err(std::io::ErrorKind::UnexpectedEof.into())
            };
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let mut msg = Http {
        head: head.trim_end().to_string(),
        body: Vec::new(),
    };
    let length = msg
        .header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    msg.body.resize(length, 0);
    from.read_exact(&mut msg.body).await?;
    Ok(Some(msg))
}

async fn serve(inner: Arc<Inner>, client: TcpStream) {
    let Ok(server) = TcpStream::connect(&inner.upstream).await else {
        return;
    };
    let (cr, mut cw) = client.into_split();
    let (sr, mut sw) = server.into_split();
    let (mut cr, mut sr) = (BufReader::new(cr), BufReader::new(sr));
    while let Ok(Some(request)) = read_http(&mut cr).await {
        let answer = match relay(&inner, request, &mut sw, &mut sr).await {
            Ok(answer) => answer,
            Err(_) => return,
        };
        if cw.write_all(&answer.to_wire()).await.is_err() {
            return;
        }
    }
}

/// Answers one request: through the server, with the throttling rules applied.
async fn relay<W, R>(
    inner: &Inner,
    mut request: Http,
    to_server: &mut W,
    from_server: &mut BufReader<R>,
) -> std::io::Result<Http>
where
    W: AsyncWrite + Unpin,
    R: AsyncRead + Unpin,
{
    let is_put = request.header("x-amz-target") == Some(PUT_RECORDS);
    if is_put && take_call(inner) {
        inner.throttled.fetch_add(1, Ordering::Relaxed);
        let body = json!({
            "__type": THROTTLED,
            "message": "Rate exceeded for stream (onceflow test throttle)",
        });
        return Ok(Http {
            head: "HTTP/1.1 400 Bad Request\r\nContent-Type: application/x-amz-json-1.1".into(),
            body: body.to_string().into_bytes(),
        });
    }
    // The indices of the entries taken out of a PutRecords call, and how many are left.
    let mut failed = Vec::new();
    let mut left = 0;
    if is_put {
        if let Ok(mut call) = serde_json::from_slice::<Value>(&request.body) {
            if let Some(Value::Array(entries)) = call.get_mut("Records") {
                let mut index = 0;
                entries.retain(|e| {
                    let key = e.get("PartitionKey").and_then(Value::as_str).unwrap_or("");
                    let keep = !take_entry(inner, key);
                    if !keep {
                        failed.push(index);
                    }
                    index += 1;
                    keep
                });
                left = entries.len();
            }
            if !failed.is_empty() {
                request.body = call.to_string().into_bytes();
            }
        }
    }
    if !failed.is_empty() && left == 0 {
        // Nothing left to write: the whole call fails entry by entry.
        return Ok(Http {
            head: "HTTP/1.1 200 OK\r\nContent-Type: application/x-amz-json-1.1".into(),
            body: with_failures(
                json!({"FailedRecordCount": 0, "Records": []}),
                &failed,
                inner,
            ),
        });
    }
    to_server.write_all(&request.to_wire()).await?;
    let mut answer = read_http(from_server)
        .await?
        .ok_or(std::io::ErrorKind::UnexpectedEof)?;
    if !failed.is_empty() {
        if let Ok(out) = serde_json::from_slice::<Value>(&answer.body) {
            answer.body = with_failures(out, &failed, inner);
        }
    }
    Ok(answer)
}

/// A PutRecords answer with throttled entries put back at `failed` (indices in the caller's
/// call, ascending) and `FailedRecordCount` raised to match.
fn with_failures(mut out: Value, failed: &[usize], inner: &Inner) -> Vec<u8> {
    let written = match out.get_mut("Records") {
        Some(Value::Array(r)) => std::mem::take(r),
        _ => Vec::new(),
    };
    let total = written.len() + failed.len();
    let mut written = written.into_iter();
    let records: Vec<Value> = (0..total)
        .map(|i| {
            if failed.contains(&i) {
                inner.throttled.fetch_add(1, Ordering::Relaxed);
                json!({
                    "ErrorCode": THROTTLED,
                    "ErrorMessage": "Rate exceeded for shard (onceflow test throttle)",
                })
            } else {
                written.next().unwrap_or(Value::Null)
            }
        })
        .collect();
    let before = out
        .get("FailedRecordCount")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    out["FailedRecordCount"] = json!(before + failed.len() as u64);
    out["Records"] = Value::Array(records);
    out.to_string().into_bytes()
}

fn take_call(inner: &Inner) -> bool {
    let mut rules = inner.rules.lock().unwrap();
    if rules.calls == 0 {
        return false;
    }
    rules.calls -= 1;
    true
}

fn take_entry(inner: &Inner, key: &str) -> bool {
    let mut rules = inner.rules.lock().unwrap();
    let Some(i) = rules.entries.iter().position(|(k, n)| k == key && *n > 0) else {
        return false;
    };
    rules.entries[i].1 -= 1;
    true
}
