//! A fault layer between a client and a real broker on loopback: a TCP relay that reads the
//! frames of both directions and, by rule, delays a frame, drops it, or cuts the connection
//! when one passes. Every other byte is relayed unchanged, in order. Three framings
//! ([`Framing`]): length-prefixed (Kafka and Pulsar both frame every request and response with
//! a 4-byte big-endian size), the NATS client protocol's lines and messages, and raw (whatever
//! one read returns: Redis, PostgreSQL, HTTP).
//!
//! The faults of issue #28, and how each is made with it:
//! - latency with jitter: [`FaultProxy::always`] with [`Action::Jitter`] on every frame;
//! - a reset connection: [`FaultProxy::cut_all`], or [`Action::Cut`] when a chosen frame passes;
//! - one direction black-holed: [`Action::Drop`] on every frame of that direction (the
//!   connection stays open, nothing arrives);
//! - one broker cut off: [`FaultProxy::isolate`] (open connections closed, new ones accepted
//!   and held without an answer until [`FaultProxy::heal`], as behind a partition).
//!
//! Brokers hand clients the addresses they advertise, so a client would leave the proxy after its
//! first metadata lookup: the broker scripts give each broker a listener that advertises the
//! proxy's address (Kafka: `ONCEFLOW_KAFKA_FAULT_URL`, see `tests/brokers/kafka/up.sh`), and the
//! proxy relays to that listener.
//!
//! ```no_run
//! # async fn f() {
//! use onceflow_conformance::fault_proxy::{Action, Direction, FaultProxy, kafka_api_key};
//! let proxy = FaultProxy::start("127.0.0.1:19095", "127.0.0.1:19094").await.unwrap();
//! // Hold back the next EndTxn request (Kafka API key 26) for 6 s.
//! proxy.once(Direction::ToBroker, |f| kafka_api_key(f) == Some(26),
//!            Action::Delay(std::time::Duration::from_secs(6)));
//! # }
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Which way a frame travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Client to broker (requests, Pulsar's sends and acks).
    ToBroker,
    /// Broker to client (responses, Pulsar's receipts and messages).
    ToClient,
}

/// What happens to a frame a rule matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Hold the frame (and everything after it on that connection and direction) this long,
    /// then relay it: a slow link, not a lost frame.
    Delay(Duration),
    /// Drop the frame and close the connection both ways, as a reset link would.
    Cut,
    /// Drop the frame and relay on: a frame lost on a live connection. Only for protocols that
    /// live with a missing frame (NATS: a message the server sent that never arrives, such as
    /// a JetStream publish ack); a Kafka or Pulsar client would wait for its lost response
    /// (until its request timeout: a black hole).
    Drop,
    /// Hold the frame a time drawn uniformly from `min..=max`, then relay it (as
    /// [`Action::Delay`]; frames of one connection and direction stay in order, so a slow frame
    /// holds the ones behind it, as on a TCP stream).
    Jitter {
        /// Shortest hold.
        min: Duration,
        /// Longest hold.
        max: Duration,
    },
}

/// How the bytes of a connection divide into frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// A 4-byte big-endian size, then that many bytes (Kafka, Pulsar). Rules see the frame
    /// without its size.
    LengthPrefixed,
    /// The NATS client protocol: a control line ending in CRLF (`INFO`, `PING`, `SUB`, ...),
    /// and for `MSG`, `HMSG`, `PUB` and `HPUB` the payload of the size the line gives (the
    /// last number: the total, headers included) and its CRLF. Rules see the whole frame,
    /// control line included (see [`nats_payload`]).
    Nats,
    /// No framing: each read from the socket (up to 64 KiB) is one frame. For protocols whose
    /// faults are whole-connection ones (Redis, PostgreSQL, HTTP): a rule sees a chunk that may
    /// hold part of a request or several.
    Raw,
}

type Matcher = Box<dyn Fn(&[u8]) -> bool + Send + Sync>;

struct Rule {
    direction: Direction,
    matcher: Matcher,
    action: Action,
    /// How many more frames this rule applies to (`None`: every one).
    remaining: Option<usize>,
}

struct Inner {
    upstream: String,
    framing: Framing,
    rules: Mutex<Vec<Rule>>,
    /// Bumped by [`FaultProxy::cut_all`]: every connection open at that moment closes.
    cut: watch::Sender<u64>,
    connections: AtomicUsize,
    fired: AtomicUsize,
    /// Set by [`FaultProxy::isolate`]: new connections are held, unanswered.
    isolated: watch::Sender<bool>,
    /// Set when the [`FaultProxy`] is dropped: held connections close instead of relaying.
    closed: std::sync::atomic::AtomicBool,
}

/// A running fault proxy; stops relaying (and closes its connections) when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    inner: Arc<Inner>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on `listen` (`host:port`; port 0 picks one) and relays each connection to
    /// `upstream`, in length-prefixed frames (Kafka, Pulsar). Errors if the address cannot be
    /// bound (one in use is tried again for up to 5 s: a proxy just dropped frees its port on
    /// the runtime's next turn).
    pub async fn start(listen: &str, upstream: &str) -> std::io::Result<FaultProxy> {
        Self::start_with(listen, upstream, Framing::LengthPrefixed).await
    }

    /// [`FaultProxy::start`] without framing ([`Framing::Raw`]): for Redis, PostgreSQL or HTTP,
    /// where the faults are connection cuts, black holes and delays of whole chunks.
    pub async fn start_raw(listen: &str, upstream: &str) -> std::io::Result<FaultProxy> {
        Self::start_with(listen, upstream, Framing::Raw).await
    }

    /// [`FaultProxy::start`] for a NATS server: the frames are the NATS protocol's
    /// ([`Framing::Nats`]). A client connected through it stays behind it as long as the
    /// server advertises no other address (a single server on loopback advertises none).
    pub async fn start_nats(listen: &str, upstream: &str) -> std::io::Result<FaultProxy> {
        Self::start_with(listen, upstream, Framing::Nats).await
    }

    /// [`FaultProxy::start`] on a fixed address another test, or another test binary, may
    /// hold for a while (a broker's advertised fault listener): tried again every 200 ms for
    /// up to `wait`, each failed try logged to stderr. Panics with `listen` and the last error
    /// once `wait` has passed (for tests only).
    pub async fn start_when_free(listen: &str, upstream: &str, wait: Duration) -> FaultProxy {
        let deadline = std::time::Instant::now() + wait;
        loop {
            match Self::start(listen, upstream).await {
                Ok(p) => return p,
                Err(e) if std::time::Instant::now() < deadline => {
                    eprintln!("fault proxy on {listen}: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("fault proxy on {listen}: {e}"),
            }
        }
    }

    async fn start_with(
        listen: &str,
        upstream: &str,
        framing: Framing,
    ) -> std::io::Result<FaultProxy> {
        // A proxy dropped just before on the same port frees it once its accept task is
        // cancelled (on the runtime's next turn): wait a little for that rather than fail.
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match TcpListener::bind(listen).await {
                Ok(l) => break l,
                Err(e)
                    if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => return Err(e),
            }
        };
        let addr = listener.local_addr()?;
        let (cut, _) = watch::channel(0u64);
        let (isolated, _) = watch::channel(false);
        let inner = Arc::new(Inner {
            upstream: upstream.to_string(),
            framing,
            rules: Mutex::new(Vec::new()),
            cut,
            connections: AtomicUsize::new(0),
            fired: AtomicUsize::new(0),
            isolated,
            closed: Default::default(),
        });
        let accept = tokio::spawn({
            let inner = inner.clone();
            async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    let inner = inner.clone();
                    tokio::spawn(async move {
                        // Behind a partition: the connection is accepted (the kernel does that
                        // anyway) but nothing answers until the proxy heals; then it is relayed.
                        let mut isolated = inner.isolated.subscribe();
                        if isolated.wait_for(|i| !*i).await.is_err()
                            || inner.closed.load(Ordering::Relaxed)
                        {
                            return;
                        }
                        if let Ok(broker) = TcpStream::connect(&inner.upstream).await {
                            inner.connections.fetch_add(1, Ordering::Relaxed);
                            relay(inner, client, broker).await;
                        }
                    });
                }
            }
        });
        Ok(FaultProxy {
            addr,
            inner,
            accept,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Applies `action` to the next frame going `direction` that `matcher` accepts (the whole
    /// frame, size prefix excluded), once.
    pub fn once(
        &self,
        direction: Direction,
        matcher: impl Fn(&[u8]) -> bool + Send + Sync + 'static,
        action: Action,
    ) {
        self.add(direction, Box::new(matcher), action, Some(1));
    }

    /// Applies `action` to every frame going `direction` that `matcher` accepts, until
    /// [`FaultProxy::clear`].
    pub fn always(
        &self,
        direction: Direction,
        matcher: impl Fn(&[u8]) -> bool + Send + Sync + 'static,
        action: Action,
    ) {
        self.add(direction, Box::new(matcher), action, None);
    }

    fn add(&self, direction: Direction, matcher: Matcher, action: Action, times: Option<usize>) {
        self.inner.rules.lock().unwrap().push(Rule {
            direction,
            matcher,
            action,
            remaining: times,
        });
    }

    /// Removes every rule.
    pub fn clear(&self) {
        self.inner.rules.lock().unwrap().clear();
    }

    /// Closes every connection open now (new ones are relayed as before).
    pub fn cut_all(&self) {
        self.inner.cut.send_modify(|g| *g += 1);
    }

    /// Cuts this upstream off: every open connection closes and new ones are accepted but held,
    /// unanswered, until [`FaultProxy::heal`] (a broker behind a network partition: clients
    /// see their requests time out, not a refused connection).
    pub fn isolate(&self) {
        self.inner.isolated.send_replace(true);
        self.cut_all();
    }

    /// Ends [`FaultProxy::isolate`]: held and new connections are relayed again.
    pub fn heal(&self) {
        self.inner.isolated.send_replace(false);
    }

    /// How many times a rule has fired.
    pub fn fired(&self) -> usize {
        self.inner.fired.load(Ordering::Relaxed)
    }

    /// How many connections have been relayed so far.
    pub fn connections(&self) -> usize {
        self.inner.connections.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.inner.closed.store(true, Ordering::Relaxed);
        self.heal();
        self.cut_all();
    }
}

async fn relay(inner: Arc<Inner>, client: TcpStream, broker: TcpStream) {
    let _ = client.set_nodelay(true);
    let _ = broker.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (br, bw) = broker.into_split();
    let mut cut = inner.cut.subscribe();
    cut.borrow_and_update();
    let up = pump(inner.clone(), Direction::ToBroker, cr, bw);
    let down = pump(inner.clone(), Direction::ToClient, br, cw);
    // Either side ending (EOF, error, a Cut rule) or a cut_all ends the connection both ways:
    // dropping the halves closes both sockets.
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = cut.changed() => {}
    }
}

/// What the rules say about one frame.
fn decide(inner: &Inner, direction: Direction, frame: &[u8]) -> Option<Action> {
    let mut rules = inner.rules.lock().unwrap();
    let i = rules
        .iter()
        .position(|r| r.direction == direction && r.remaining != Some(0) && (r.matcher)(frame))?;
    let rule = &mut rules[i];
    if let Some(n) = &mut rule.remaining {
        *n -= 1;
    }
    let action = rule.action;
    if rule.remaining == Some(0) {
        rules.remove(i);
    }
    inner.fired.fetch_add(1, Ordering::Relaxed);
    Some(action)
}

async fn pump(
    inner: Arc<Inner>,
    direction: Direction,
    from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
) -> std::io::Result<()> {
    // Frames are read as they come and written at their delivery time by a writer of their
    // own: a delayed frame holds the ones behind it (TCP keeps order) but frames read while it
    // waits are not delayed again on top, so a steady latency stays one latency, as on a slow
    // link, not one per frame queued.
    let (queue, mut queued) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = async move {
        while let Some((at, wire)) = queued.recv().await {
            tokio::time::sleep_until(at).await;
            to.write_all(&wire).await?;
        }
        Ok::<(), std::io::Error>(())
    };
    let reader = async move {
        let mut from = BufReader::new(from);
        let mut last = Instant::now();
        loop {
            // One frame as it came, and where in it the part the rules see starts.
            let mut wire = Vec::new();
            let start = match inner.framing {
                Framing::LengthPrefixed => {
                    let mut size = [0u8; 4];
                    from.read_exact(&mut size).await?;
                    wire.extend_from_slice(&size);
                    wire.resize(4 + u32::from_be_bytes(size) as usize, 0);
                    from.read_exact(&mut wire[4..]).await?;
                    4
                }
                Framing::Nats => {
                    read_nats_frame(&mut from, &mut wire).await?;
                    0
                }
                Framing::Raw => {
                    wire.resize(64 * 1024, 0);
                    let n = from.read(&mut wire).await?;
                    if n == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    wire.truncate(n);
                    0
                }
            };
            let delay = match decide(&inner, direction, &wire[start..]) {
                Some(Action::Cut) => return Ok(()),
                Some(Action::Drop) => continue,
                Some(Action::Delay(d)) => d,
                Some(Action::Jitter { min, max }) if max > min => {
                    use rand::Rng;
                    min + (max - min).mul_f64(rand::rng().random::<f64>())
                }
                Some(Action::Jitter { min, .. }) => min,
                None => Duration::ZERO,
            };
            last = last.max(Instant::now() + delay);
            if queue.send((last, wire)).is_err() {
                return Ok(());
            }
        }
    };
    tokio::select! {
        r = reader => r,
        r = writer => r,
    }
}

/// Reads one NATS protocol frame into `wire` (see [`Framing::Nats`]).
async fn read_nats_frame(
    from: &mut BufReader<OwnedReadHalf>,
    wire: &mut Vec<u8>,
) -> std::io::Result<()> {
    if from.read_until(b'\n', wire).await? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    if let Some(size) = nats_payload_size(wire) {
        let line = wire.len();
        wire.resize(line + size + 2, 0);
        from.read_exact(&mut wire[line..]).await?;
    }
    Ok(())
}

/// The payload size a NATS control line announces (`MSG`, `HMSG`, `PUB`, `HPUB`: its last
/// number, headers included), `None` for a line without payload.
fn nats_payload_size(line: &[u8]) -> Option<usize> {
    let line = std::str::from_utf8(line).ok()?;
    let mut words = line.split_ascii_whitespace();
    let op = words.next()?.to_ascii_uppercase();
    if !matches!(op.as_str(), "MSG" | "HMSG" | "PUB" | "HPUB") {
        return None;
    }
    words.last()?.parse().ok()
}

/// The payload of a NATS `MSG` or `HMSG` frame (headers skipped), `None` for any other
/// frame: what a rule matches a reply on, such as a JetStream publish ack
/// (`{"stream":"…","seq":…}`).
pub fn nats_payload(frame: &[u8]) -> Option<&[u8]> {
    let end = frame.iter().position(|b| *b == b'\n')?;
    let line = std::str::from_utf8(&frame[..end]).ok()?;
    let words: Vec<&str> = line.split_ascii_whitespace().collect();
    let op = words.first()?.to_ascii_uppercase();
    let headers = match op.as_str() {
        "MSG" => 0,
        // HMSG <subject> <sid> [reply-to] <header bytes> <total bytes>
        "HMSG" => words.get(words.len().checked_sub(2)?)?.parse().ok()?,
        _ => return None,
    };
    let total: usize = words.last()?.parse().ok()?;
    frame.get(end + 1 + headers..end + 1 + total)
}

/// The API key of a Kafka request frame (the first field of every request header; EndTxn is
/// 26, AddOffsetsToTxn 25, TxnOffsetCommit 28, InitProducerId 22, Produce 0; see the Kafka
/// protocol guide). `None` for a frame too short to hold one.
pub fn kafka_api_key(frame: &[u8]) -> Option<i16> {
    Some(i16::from_be_bytes([*frame.first()?, *frame.get(1)?]))
}

/// The command type of a Pulsar frame (`BaseCommand.type`, field 1, the first field on the
/// wire after the 4-byte command size; SEND is 6, SEND_RECEIPT 7, MESSAGE 9, ACK 10; see
/// PulsarApi.proto). `None` if the frame does not start that way.
pub fn pulsar_command_type(frame: &[u8]) -> Option<i32> {
    let cmd = frame.get(4..)?;
    if *cmd.first()? != 0x08 {
        return None;
    }
    let mut value: i32 = 0;
    for (i, b) in cmd[1..].iter().take(5).enumerate() {
        value |= i32::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_kafka_api_key_and_the_pulsar_command_type() {
        // EndTxn v3, correlation id 7.
        assert_eq!(kafka_api_key(&[0, 26, 0, 3, 0, 0, 0, 7]), Some(26));
        assert_eq!(kafka_api_key(&[0]), None);
        // Pulsar: command size 4, BaseCommand { type: SEND (6) }.
        assert_eq!(
            pulsar_command_type(&[0, 0, 0, 4, 0x08, 6, 0x32, 0]),
            Some(6)
        );
        // A two-byte varint (type 130).
        assert_eq!(
            pulsar_command_type(&[0, 0, 0, 4, 0x08, 0x82, 0x01]),
            Some(130)
        );
        assert_eq!(pulsar_command_type(&[0, 0, 0, 4, 0x10, 6]), None);
    }

    #[test]
    fn reads_the_payload_of_nats_messages() {
        assert_eq!(
            nats_payload(b"MSG _INBOX.a 1 4\r\nbody\r\n"),
            Some(&b"body"[..])
        );
        assert_eq!(
            nats_payload(b"MSG s 1 _INBOX.r 2\r\nok\r\n"),
            Some(&b"ok"[..])
        );
        // Headers (12 bytes) come before the payload; the total counts both.
        assert_eq!(
            nats_payload(b"HMSG s 1 12 16\r\nNATS/1.0\r\n\r\nbody\r\n"),
            Some(&b"body"[..])
        );
        assert_eq!(nats_payload(b"PING\r\n"), None);
        assert_eq!(nats_payload(b"PUB s 2\r\nhi\r\n"), None);
        assert_eq!(nats_payload_size(b"hpub s 2 5\r\n"), Some(5));
        assert_eq!(nats_payload_size(b"INFO {}\r\n"), None);
    }

    /// An echo server on loopback: every byte written to it comes back.
    async fn echo_server() -> String {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up_addr = upstream.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = upstream.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    loop {
                        let n = match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        up_addr
    }

    #[tokio::test]
    async fn relays_nats_frames_and_drops_one_by_rule() {
        let proxy = FaultProxy::start_nats("127.0.0.1:0", &echo_server().await)
            .await
            .unwrap();
        proxy.once(
            Direction::ToClient,
            |f| nats_payload(f) == Some(b"lost"),
            Action::Drop,
        );
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        // A payload holding a line break stays one frame.
        let sent = b"PING\r\nMSG s 1 4\r\nlost\r\nMSG s 1 6\r\nk\r\nept\r\nPONG\r\n";
        c.write_all(sent).await.unwrap();
        let want = b"PING\r\nMSG s 1 6\r\nk\r\nept\r\nPONG\r\n";
        let mut got = vec![0u8; want.len()];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(got, want);
        assert_eq!(proxy.fired(), 1);
    }

    #[tokio::test]
    async fn jitters_raw_chunks_and_isolates_the_upstream() {
        let proxy = FaultProxy::start_raw("127.0.0.1:0", &echo_server().await)
            .await
            .unwrap();
        proxy.always(
            Direction::ToBroker,
            |_| true,
            Action::Jitter {
                min: Duration::from_millis(100),
                max: Duration::from_millis(200),
            },
        );
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let t = std::time::Instant::now();
        c.write_all(b"PING\r\n").await.unwrap();
        let mut got = [0u8; 6];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"PING\r\n");
        assert!(t.elapsed() >= Duration::from_millis(100));
        proxy.clear();

        // Isolated: the open connection closes, a new one is accepted but gets no answer
        // until the proxy heals, then it is relayed.
        proxy.isolate();
        let mut rest = Vec::new();
        assert_eq!(c.read_to_end(&mut rest).await.unwrap(), 0);
        let mut held = TcpStream::connect(proxy.addr()).await.unwrap();
        held.write_all(b"x").await.unwrap();
        let mut one = [0u8; 1];
        let unanswered =
            tokio::time::timeout(Duration::from_millis(300), held.read_exact(&mut one)).await;
        assert!(unanswered.is_err(), "no answer behind the partition");
        proxy.heal();
        held.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"x");
    }

    #[tokio::test]
    async fn relays_frames_and_applies_rules() {
        let proxy = FaultProxy::start("127.0.0.1:0", &echo_server().await)
            .await
            .unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let frame = |b: &[u8]| {
            let mut v = (b.len() as u32).to_be_bytes().to_vec();
            v.extend_from_slice(b);
            v
        };
        c.write_all(&frame(b"ab")).await.unwrap();
        let mut got = [0u8; 6];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, &frame(b"ab")[..]);

        proxy.once(
            Direction::ToClient,
            |f| f == b"slow",
            Action::Delay(Duration::from_millis(300)),
        );
        let t = std::time::Instant::now();
        c.write_all(&frame(b"slow")).await.unwrap();
        let mut got = [0u8; 8];
        c.read_exact(&mut got).await.unwrap();
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert_eq!(proxy.fired(), 1);

        proxy.once(Direction::ToBroker, |f| f == b"cut", Action::Cut);
        c.write_all(&frame(b"cut")).await.unwrap();
        let mut rest = Vec::new();
        assert_eq!(c.read_to_end(&mut rest).await.unwrap(), 0);

        let mut c2 = TcpStream::connect(proxy.addr()).await.unwrap();
        c2.write_all(&frame(b"x")).await.unwrap();
        let mut got = [0u8; 5];
        c2.read_exact(&mut got).await.unwrap();
        proxy.cut_all();
        let mut rest = Vec::new();
        assert_eq!(c2.read_to_end(&mut rest).await.unwrap(), 0);
        assert_eq!(proxy.connections(), 2);
    }
}
