//! A fault layer between a client and a real broker on loopback: a TCP relay that reads the
//! length-prefixed frames of both directions (Kafka and Pulsar both frame every request and
//! response with a 4-byte big-endian size) and, by rule, delays a frame or cuts the connection
//! when one passes. Every other byte is relayed unchanged, in order.
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

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

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
    rules: Mutex<Vec<Rule>>,
    /// Bumped by [`FaultProxy::cut_all`]: every connection open at that moment closes.
    cut: watch::Sender<u64>,
    connections: AtomicUsize,
    fired: AtomicUsize,
}

/// A running fault proxy; stops relaying (and closes its connections) when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    inner: Arc<Inner>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on `listen` (`host:port`; port 0 picks one) and relays each connection to
    /// `upstream`. Errors if the address cannot be bound.
    pub async fn start(listen: &str, upstream: &str) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (cut, _) = watch::channel(0u64);
        let inner = Arc::new(Inner {
            upstream: upstream.to_string(),
            rules: Mutex::new(Vec::new()),
            cut,
            connections: AtomicUsize::new(0),
            fired: AtomicUsize::new(0),
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
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
) -> std::io::Result<()> {
    let mut size = [0u8; 4];
    let mut frame = Vec::new();
    loop {
        from.read_exact(&mut size).await?;
        let len = u32::from_be_bytes(size) as usize;
        frame.resize(len, 0);
        from.read_exact(&mut frame).await?;
        match decide(&inner, direction, &frame) {
            Some(Action::Cut) => return Ok(()),
            Some(Action::Delay(d)) => tokio::time::sleep(d).await,
            None => {}
        }
        to.write_all(&size).await?;
        to.write_all(&frame).await?;
    }
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

    #[tokio::test]
    async fn relays_frames_and_applies_rules() {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up_addr = upstream.local_addr().unwrap().to_string();
        // An echo server.
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
        let proxy = FaultProxy::start("127.0.0.1:0", &up_addr).await.unwrap();
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
