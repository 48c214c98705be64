//! TLS client-certificate authentication (mTLS, Java's `AuthenticationTls`) through an
//! in-process loopback bridge.
//!
//! The pulsar crate (6.9) builds its rustls connection `with_no_client_auth()`: it cannot
//! present a client certificate. So with `tls_cert_file` / `tls_key_file` the crate is given
//! `pulsar://127.0.0.1:PORT/mtls-bridge-to/BROKER:PORT` ([`URL_PATH`]), a listener of this
//! bridge, and the bridge makes the TLS connection to the real broker itself (client
//! certificate, trusted CAs, host name check), relaying frames both ways:
//!
//! - **Who may use the bridge.** A plaintext loopback port must not lend our client identity
//!   to another local process. The crate authenticates to the bridge with a private auth
//!   method ([`MARKER`]) whose data is a random 32-byte secret of this bridge; the bridge
//!   reads the first frame of every local connection, which must be that `CONNECT`, compares
//!   the secret in constant time, and only then connects to the broker, with the `CONNECT`
//!   rewritten to `auth_method_name = "tls"` (the broker's `AuthenticationProviderTls` takes
//!   the role from the certificate). Anything else is closed before the broker is contacted.
//!   Local connections awaiting their first frame are capped ([`MAX_AWAITING_CONNECT`], newer
//!   ones displace the oldest) and closed after [`FIRST_FRAME_TIMEOUT`], and nothing is
//!   reserved for a first frame before its size is read and checked ([`MAX_FIRST_FRAME`]), so
//!   other local processes cannot exhaust our file descriptors or memory through the bridge.
//!   A broker `AUTH_CHALLENGE` answered by the crate (`AUTH_RESPONSE`) is rewritten the same
//!   way, so the secret never leaves the process.
//! - **Lookups.** A `LOOKUP_RESPONSE` names the owning broker (`brokerServiceUrlTls`); it is
//!   rewritten to a bridge listener for that broker (one per distinct address, made on first
//!   use), so the crate reaches every broker through the bridge. An answer with
//!   `proxy_through_service_url` (a Pulsar proxy) keeps the crate on the service URL (already
//!   the bridge) and names the broker's TLS address as `proxy_to_broker_url`, as Java's
//!   client does. An answer without a TLS address fails the lookup (the crate would otherwise
//!   connect in plaintext).
//! - **Lifetime.** [`Bridge::check`] makes the first broker connection before the crate
//!   exists, so a refused certificate is onceflow's error alone; a dropped bridge relays on
//!   until the crate has closed its connections ([`Bridge`]'s `Drop`).
//! - **Frames** (`[u32 totalSize][u32 commandSize][BaseCommand][payload…]`, Pulsar's binary
//!   protocol, <https://pulsar.apache.org/docs/next/developing-binary-protocol/>): only the
//!   command's type is read; the command is decoded and encoded again only for the three
//!   commands above, every other frame (payloads included) passes byte for byte.
//!
//! The cost: every frame crosses the loopback once more and is copied through this process
//! (one extra copy per frame and direction), plus one loopback connection per broker
//! connection.

use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use futures::future::BoxFuture;
use onceflow_core::{Error, ErrorKind, Result};
use parking_lot::Mutex;
use prost::Message as _;
use pulsar::proto;
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::auth::Credentials;
use crate::config::TlsClientCert;
use crate::txn::TxnId;

/// The auth method name the crate presents to the bridge (never sent to a broker).
pub(crate) const MARKER: &str = "onceflow-loopback-mtls-bridge";

/// How long a local connection may take to send its `CONNECT` (the pulsar crate sends it as
/// soon as it is connected).
const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(1);
/// Largest first frame (a `CONNECT`) a local connection may send: the crate's `CONNECT` to the
/// bridge (client version, protocol version, auth method and the 32-byte secret, proxy URL,
/// feature flags) is a few hundred bytes.
const MAX_FIRST_FRAME: usize = 4 * 1024;
/// Most local connections that may await their first frame at once, per bridge. Other local
/// processes can open connections to the bridge's loopback ports: without a cap they could
/// hold our file descriptors and memory until the process runs out. Beyond the cap the
/// connection that has waited longest is closed at once: the crate sends its `CONNECT` within
/// moments of connecting, so a flood of idle connections displaces idle ones, not the crate's
/// (closing the crate's connection before `CONNECTED` is a fatal error to it, so refusing the
/// newest would hit the crate's reconnect during a flood).
const MAX_AWAITING_CONNECT: usize = 32;
/// Largest frame relayed (Pulsar's own limit is the broker's `maxMessageSize` plus headers).
const MAX_FRAME: usize = 256 * 1024 * 1024;
/// Bytes read at once.
const READ_CHUNK: usize = 64 * 1024;
/// How long a bridge whose platform was dropped keeps relaying for the pulsar crate, at most:
/// until the crate has closed its connections (see [`Bridge`]'s `Drop`).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// The path of the URLs the crate is given for a bridge listener: `pulsar://LOCAL/` this and
/// the broker's `host:port`. The crate connects to the host and port only; the path is there
/// so that what the crate logs and reports (`Retry #0 -> connecting producer … to broker
/// pulsar://127.0.0.1:PORT/mtls-bridge-to/BROKER`) names the broker, not just a loopback port.
const URL_PATH: &str = "mtls-bridge-to";

type Type = proto::base_command::Type;

/// A broker address the bridge connects to over TLS.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Upstream {
    /// Host name or IP address (no brackets), checked against the broker's certificate.
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Upstream {
    /// The broker of a `pulsar+ssl://host[:port]` URL (port 6651 by default), or with
    /// `tls` false of a `pulsar://host[:port]` URL (6650).
    pub(crate) fn of_url(url: &str, tls: bool) -> Option<Upstream> {
        let u = url::Url::parse(url).ok()?;
        if u.scheme() != if tls { "pulsar+ssl" } else { "pulsar" } {
            return None;
        }
        let host = u
            .host_str()?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        Some(Upstream {
            host,
            port: u.port().unwrap_or(if tls { 6651 } else { 6650 }),
        })
    }
}

/// What the bridge did, for diagnostics and tests ([`crate::PulsarPlatform::mtls_bridge`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgeStats {
    /// Each broker reached through the bridge (`host:port` of its TLS address) and the
    /// loopback address the pulsar crate connects to for it.
    pub listeners: Vec<(String, SocketAddr)>,
    /// Local connections that presented the bridge's secret and were relayed to a broker.
    pub relayed: u64,
    /// Local connections closed without contacting a broker: no `CONNECT` first, another
    /// auth method, or a wrong secret.
    pub refused_local: u64,
    /// Lookup answers (`LOOKUP_RESPONSE`) rewritten to point at a bridge listener.
    pub lookups: u64,
}

/// What the bridge presents to the brokers in the crate's place.
#[derive(Clone)]
pub(crate) enum Present {
    /// A TLS client certificate (its file, for messages): `CONNECT` and `AUTH_RESPONSE` say
    /// `tls` and carry no data.
    ClientCert(String),
    /// The connection's credential (none, token, token file, OAuth2 access token) and what it
    /// is, for messages ([`Credentials::describe`]).
    Credentials(Credentials, String),
}

impl Present {
    /// The auth method and data to present, read anew (a rotated token file, a refreshed
    /// OAuth2 token).
    pub(crate) async fn auth(
        &self,
    ) -> std::result::Result<(Option<String>, Option<Vec<u8>>), String> {
        match self {
            Present::ClientCert(_) => Ok((Some("tls".to_string()), None)),
            Present::Credentials(c, _) => Ok(match c.connect_data().await? {
                Some((m, d)) => (Some(m), Some(d)),
                None => (None, None),
            }),
        }
    }

    /// What is presented, for messages: `the client certificate PATH`, `the token`, ….
    pub(crate) fn describe(&self) -> String {
        match self {
            Present::ClientCert(file) => format!("the client certificate {file}"),
            Present::Credentials(_, what) => what.clone(),
        }
    }
}

struct Inner {
    /// TLS towards the brokers (`pulsar+ssl://`); plaintext without.
    tls: Option<tokio_rustls::TlsConnector>,
    /// With `transactions=true`: the transactions put on the crate's frames.
    txn: Option<Arc<TxnFrames>>,
    secret: [u8; 32],
    present: Present,
    connect_timeout: Duration,
    listeners: Mutex<HashMap<Upstream, SocketAddr>>,
    /// The last refusal of a broker connection (certificate, TLS alert, broker's
    /// AuthenticationError), for [`Bridge::take_refusal`].
    refusal: Mutex<Option<Error>>,
    stop: CancellationToken,
    relayed: AtomicU64,
    refused_local: AtomicU64,
    lookups: AtomicU64,
    /// Local connections accepted that have not sent their first frame yet, oldest first
    /// (at most [`MAX_AWAITING_CONNECT`]), each with the token that closes it.
    awaiting: Mutex<VecDeque<(u64, CancellationToken)>>,
    next_local: AtomicU64,
    /// Local connections accepted and not ended yet (awaiting their `CONNECT` or relayed).
    open: AtomicUsize,
    /// Notified when one of them ends.
    ended: Notify,
}

impl Inner {
    /// Waits until no local connection is open, at most `limit`.
    async fn drained(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, async {
            loop {
                let ended = self.ended.notified();
                tokio::pin!(ended);
                ended.as_mut().enable();
                if self.open.load(Ordering::Acquire) == 0 {
                    return;
                }
                ended.await;
            }
        })
        .await;
    }
}

/// One local connection in [`Inner::open`], counted from its accept to its end.
struct Open(Arc<Inner>);

impl Open {
    fn new(inner: &Arc<Inner>) -> Open {
        inner.open.fetch_add(1, Ordering::AcqRel);
        Open(inner.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.ended.notify_waiters();
    }
}

/// The URL the crate is given for the bridge listener `local` of `upstream` (see [`URL_PATH`]).
fn crate_url(local: SocketAddr, upstream: &Upstream) -> String {
    format!("pulsar://{local}/{URL_PATH}/{upstream}")
}

/// A local connection in [`Inner::awaiting`] until its first frame has come (or it ends).
struct Awaiting<'a> {
    inner: &'a Inner,
    id: u64,
    /// Cancelled when the connection is displaced by newer ones.
    displaced: CancellationToken,
}

impl<'a> Awaiting<'a> {
    /// Registers a new local connection, closing the one that has waited longest when
    /// [`MAX_AWAITING_CONNECT`] are waiting already.
    fn enter(inner: &'a Inner) -> Awaiting<'a> {
        let id = inner.next_local.fetch_add(1, Ordering::Relaxed);
        let displaced = CancellationToken::new();
        let mut waiting = inner.awaiting.lock();
        while waiting.len() >= MAX_AWAITING_CONNECT {
            if let Some((_, oldest)) = waiting.pop_front() {
                oldest.cancel();
            }
        }
        waiting.push_back((id, displaced.clone()));
        Awaiting {
            inner,
            id,
            displaced,
        }
    }
}

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        self.inner.awaiting.lock().retain(|(id, _)| *id != self.id);
    }
}

/// The loopback bridge of one connection ([`crate::PulsarPlatform`]); its listeners and
/// relays stop once it is dropped and the pulsar crate has closed its connections through it.
pub(crate) struct Bridge {
    inner: Arc<Inner>,
    service: SocketAddr,
    upstream: Upstream,
}

/// The bridge goes on relaying until the pulsar crate has closed every connection it made
/// through it (at most [`DRAIN_TIMEOUT`]): the crate closes a producer or consumer that is
/// dropped from a task of its own (`CLOSE_PRODUCER` / `CLOSE_CONSUMER`), and its connections
/// once the last of its handles is gone, all after the platform that holds the bridge may have
/// been dropped. Stopped at once, the bridge cut those requests off and the crate logged an
/// ERROR for each ("could not close producer …: Disconnected"). Outside a tokio runtime (its
/// tasks are gone then anyway) it stops at once.
impl Drop for Bridge {
    fn drop(&mut self) {
        let inner = self.inner.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let t0 = tokio::time::Instant::now();
                    inner.drained(DRAIN_TIMEOUT).await;
                    inner.stop.cancel();
                    tracing::debug!(
                        waited_ms = t0.elapsed().as_millis() as u64,
                        still_open = inner.open.load(Ordering::Acquire),
                        "Pulsar bridge: stopped"
                    );
                });
            }
            Err(_) => {
                self.inner.stop.cancel();
                tracing::debug!("Pulsar bridge: stopped (outside a runtime)");
            }
        }
    }
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge")
            .field("service", &self.service)
            .field("secret", &"***")
            .finish()
    }
}

impl Bridge {
    /// Starts the bridge with a listener for `service` (the URL's broker). Must run inside a
    /// tokio runtime.
    pub(crate) fn start(
        service: Upstream,
        tls: Option<Arc<rustls::ClientConfig>>,
        present: Present,
        txn: Option<Arc<TxnFrames>>,
        connect_timeout: Duration,
    ) -> Result<Bridge> {
        let inner = Arc::new(Inner {
            tls: tls.map(tokio_rustls::TlsConnector::from),
            txn,
            secret: rand::random(),
            present,
            connect_timeout,
            listeners: Mutex::new(HashMap::new()),
            refusal: Mutex::new(None),
            stop: CancellationToken::new(),
            relayed: AtomicU64::new(0),
            refused_local: AtomicU64::new(0),
            lookups: AtomicU64::new(0),
            awaiting: Mutex::new(VecDeque::new()),
            next_local: AtomicU64::new(0),
            open: AtomicUsize::new(0),
            ended: Notify::new(),
        });
        let local = listen(&inner, service.clone()).map_err(|e| {
            Error::new(
                ErrorKind::Connect,
                format!("cannot open the loopback listener of the Pulsar bridge: {e}"),
            )
        })?;
        Ok(Bridge {
            inner,
            service: local,
            upstream: service,
        })
    }

    /// The service URL given to the pulsar crate:
    /// `pulsar://127.0.0.1:PORT/mtls-bridge-to/BROKER:PORT` ([`URL_PATH`]).
    pub(crate) fn local_url(&self) -> String {
        crate_url(self.service, &self.upstream)
    }

    /// Connects to the service URL's broker with what the bridge presents (the client
    /// certificate, the credential) as the crate's first connection would, before the crate
    /// does: TCP, TLS, `CONNECT`, the broker's answer. A certificate or credential the broker
    /// refuses is then this `Auth` error, returned by `connect`, and the crate, which would log
    /// its own ERROR for the refusal before onceflow reported it, is never started. `Connect`
    /// (or `Timeout`) when the broker cannot be reached or answers otherwise.
    pub(crate) async fn check(&self) -> Result<()> {
        let server = self.upstream.to_string();
        let tls = connect_upstream(&self.inner, &self.upstream)
            .await
            .map_err(|(e, _)| e)?;
        let (auth_method_name, auth_data) = self.inner.present.auth().await.map_err(|e| {
            Error::new(
                ErrorKind::Auth,
                format!("Pulsar at {server}: no credential to present: {e}"),
            )
        })?;
        let connect = encode_frame(
            &proto::BaseCommand {
                r#type: Type::Connect as i32,
                connect: Some(proto::CommandConnect {
                    client_version: format!("onceflow-check-{}", env!("CARGO_PKG_VERSION")),
                    auth_method_name,
                    auth_data,
                    protocol_version: Some(12),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        );
        let (_, mut writer, answer, _) = send_connect(&self.inner, tls, &server, &connect).await?;
        let _ = writer.shutdown().await;
        match refusal_of(&self.inner, &server, &answer) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The crate's credential towards the bridge.
    pub(crate) fn authentication(&self) -> pulsar::Authentication {
        pulsar::Authentication {
            name: MARKER.to_string(),
            data: self.inner.secret.to_vec(),
        }
    }

    /// The last refusal of a broker connection, if any (taken).
    pub(crate) fn take_refusal(&self) -> Option<Error> {
        self.inner.refusal.lock().take()
    }

    pub(crate) fn stats(&self) -> BridgeStats {
        let mut listeners: Vec<(String, SocketAddr)> = self
            .inner
            .listeners
            .lock()
            .iter()
            .map(|(u, a)| (u.to_string(), *a))
            .collect();
        listeners.sort();
        BridgeStats {
            listeners,
            relayed: self.inner.relayed.load(Ordering::Relaxed),
            refused_local: self.inner.refused_local.load(Ordering::Relaxed),
            lookups: self.inner.lookups.load(Ordering::Relaxed),
        }
    }
}

/// The loopback address relaying to `upstream`, its listener started on first use.
fn listen(inner: &Arc<Inner>, upstream: Upstream) -> std::io::Result<SocketAddr> {
    let mut listeners = inner.listeners.lock();
    if let Some(a) = listeners.get(&upstream) {
        return Ok(*a);
    }
    let std_listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    std_listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(std_listener)?;
    let addr = listener.local_addr()?;
    listeners.insert(upstream.clone(), addr);
    drop(listeners);
    tracing::debug!(broker = %upstream, local = %addr, "Pulsar bridge: listening");
    let inner = inner.clone();
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = inner.stop.cancelled() => break,
                a = listener.accept() => a,
            };
            match accepted {
                Ok((client, peer)) => {
                    let i = inner.clone();
                    let up = upstream.clone();
                    let open = Open::new(&inner);
                    tokio::spawn(async move {
                        let _open = open;
                        tokio::select! {
                            _ = i.stop.cancelled() => {}
                            _ = serve(i.clone(), client, peer, up) => {}
                        }
                    });
                }
                Err(e) => {
                    tracing::debug!(error = %e, "Pulsar bridge: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    Ok(addr)
}

/// One local connection: check its `CONNECT`, connect to the broker, relay.
fn serve(
    inner: Arc<Inner>,
    mut client: TcpStream,
    peer: SocketAddr,
    upstream: Upstream,
) -> BoxFuture<'static, ()> {
    Box::pin(async move {
        let awaiting = Awaiting::enter(&inner);
        let _ = client.set_nodelay(true);
        // Nothing is reserved before the first frame's size is known (see `read_frame`).
        let mut cbuf = BytesMut::new();
        let first = tokio::select! {
            f = tokio::time::timeout(
                FIRST_FRAME_TIMEOUT,
                read_frame(&mut client, &mut cbuf, MAX_FIRST_FRAME),
            ) => Some(f),
            _ = awaiting.displaced.cancelled() => None,
        };
        drop(awaiting);
        let frame = match first {
            Some(Ok(Ok(Some(f)))) => f,
            Some(Ok(Ok(None))) => return refuse_local(&inner, peer, "closed before CONNECT"),
            Some(Ok(Err(_))) => return refuse_local(&inner, peer, "no valid Pulsar frame"),
            Some(Err(_)) => return refuse_local(&inner, peer, "no CONNECT within 1 s"),
            None => {
                return refuse_local(
                    &inner,
                    peer,
                    "no CONNECT yet while newer local connections came beyond the cap",
                )
            }
        };
        let presented = match check_connect(&frame, &inner.secret) {
            Ok(c) => c,
            Err(why) => return refuse_local(&inner, peer, why),
        };
        let connect = match inner.present.auth().await {
            Ok((method, data)) => presented(method, data),
            Err(e) => {
                let e = Error::new(
                    ErrorKind::Auth,
                    format!("Pulsar at {upstream}: no credential to present: {e}"),
                );
                return fail(&inner, &mut client, e).await;
            }
        };
        inner.relayed.fetch_add(1, Ordering::Relaxed);
        let server = upstream.to_string();
        // A broker that cannot be reached (refused or timed out, as while it restarts) gets no
        // ERROR answer: the crate takes any answer but CONNECTED as fatal (it retries only a
        // connection attempt that was refused or timed out), and its consumers would stop for
        // good. So the bridge says nothing and keeps trying until the broker answers or the
        // crate gives the attempt up (its connection timeout, retried with its own backoff).
        let tls = loop {
            let attempt = tokio::select! {
                a = connect_upstream(&inner, &upstream) => a,
                r = client.read_buf(&mut cbuf) => {
                    if matches!(r, Ok(0) | Err(_)) {
                        return;
                    }
                    continue;
                }
            };
            match attempt {
                Ok(s) => break s,
                Err((e, true)) => {
                    tracing::debug!(error = %e, "Pulsar bridge: broker unreachable, trying again");
                    let mut refusal = inner.refusal.lock();
                    if refusal.is_none() {
                        *refusal = Some(e);
                    }
                }
                Err((e, false)) => return fail(&inner, &mut client, e).await,
            }
        };
        let (ur, uw, answer, ubuf) = match send_connect(&inner, tls, &server, &connect).await {
            Ok(sent) => sent,
            Err(e) => return fail(&inner, &mut client, e).await,
        };
        if let Some(e) = refusal_of(&inner, &server, &answer) {
            tracing::debug!(broker = %server, error = %e, "Pulsar bridge: CONNECT refused");
            *inner.refusal.lock() = Some(e);
        }
        if client.write_all(&answer).await.is_err() {
            return;
        }
        let (cr, cw) = client.into_split();
        // With transactions, the bridge writes transactional acknowledgements of its own on
        // the connection (see `TxnFrames::expect_acks`).
        let (inject, injected) = if inner.txn.as_ref().is_some_and(|t| t.transactions) {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let conn = Mutex::new(ConnFrames {
            id: NEXT_CONN.fetch_add(1, Ordering::Relaxed),
            inject,
            ..ConnFrames::default()
        });
        let up = pump(cr, uw, cbuf, injected, &inner, &conn, Direction::ToBroker);
        let down = pump(ur, cw, ubuf, None, &inner, &conn, Direction::ToClient);
        let result = tokio::select! {
            r = up => r,
            r = down => r,
        };
        if let Err(e) = result {
            tracing::debug!(broker = %server, error = %e, "Pulsar bridge: connection ended");
        }
    })
}

fn refuse_local(inner: &Inner, peer: SocketAddr, why: &str) {
    inner.refused_local.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(
        %peer,
        reason = why,
        "Pulsar bridge: closed a local connection without contacting the broker"
    );
}

/// The byte stream to a broker: TCP, or TLS over TCP.
type UpstreamStream = Box<dyn crate::wire::Io>;

/// A connection to a broker, split.
type UpstreamRead = tokio::io::ReadHalf<UpstreamStream>;
type UpstreamWrite = tokio::io::WriteHalf<UpstreamStream>;

/// Sends `connect` (a `CONNECT` frame for the broker) on `tls` and reads the broker's answer:
/// the connection's halves, the answer frame (`CONNECTED`, or an `ERROR`: see [`refusal_of`])
/// and what was read after it; or why there is no answer. With TLS 1.3 a refused client
/// certificate shows here, as an alert, since the client's side of the handshake ends before
/// the server checks it.
async fn send_connect(
    inner: &Inner,
    tls: UpstreamStream,
    server: &str,
    connect: &[u8],
) -> Result<(UpstreamRead, UpstreamWrite, BytesMut, BytesMut)> {
    let (mut ur, mut uw) = tokio::io::split(tls);
    if let Err(e) = async {
        uw.write_all(connect).await?;
        uw.flush().await
    }
    .await
    {
        return Err(refused_after_handshake(&inner.present, server, &e));
    }
    let mut ubuf = BytesMut::with_capacity(READ_CHUNK);
    let answer = tokio::time::timeout(
        inner.connect_timeout,
        read_frame(&mut ur, &mut ubuf, MAX_FRAME),
    )
    .await;
    match answer {
        Ok(Ok(Some(a))) => Ok((ur, uw, a, ubuf)),
        Ok(Ok(None)) => Err(Error::new(
            ErrorKind::Connect,
            format!(
                "the Pulsar broker at {server} closed the connection before answering \
                 CONNECT (does it accept {}?)",
                inner.present.describe()
            ),
        )),
        Ok(Err(e)) => Err(refused_after_handshake(&inner.present, server, &e)),
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!(
                "the Pulsar broker at {server} did not answer CONNECT within {} ms",
                inner.connect_timeout.as_millis()
            ),
        )),
    }
}

/// The broker's refusal, when its answer to `CONNECT` is an `ERROR`: `Auth` for an
/// AuthenticationError or AuthorizationError (a refused certificate), `Connect` for the rest.
fn refusal_of(inner: &Inner, server: &str, answer: &[u8]) -> Option<Error> {
    let err = error_of(answer)?;
    let refused = err.error == proto::ServerError::AuthenticationError as i32
        || err.error == proto::ServerError::AuthorizationError as i32;
    Some(Error::new(
        if refused {
            ErrorKind::Auth
        } else {
            ErrorKind::Connect
        },
        format!(
            "Pulsar at {server} refused {}: {}",
            inner.present.describe(),
            onceflow_core::shown(&err.message)
        ),
    ))
}

/// Records `e` as the refusal (when it is one), tells the crate with an ERROR frame and
/// closes its connection.
async fn fail(inner: &Inner, client: &mut TcpStream, e: Error) {
    tracing::debug!(error = %e, "Pulsar bridge: no connection to the broker");
    let server_error = if e.kind() == ErrorKind::Auth {
        proto::ServerError::AuthenticationError
    } else {
        proto::ServerError::ServiceNotReady
    };
    let frame = encode_frame(
        &proto::BaseCommand {
            r#type: Type::Error as i32,
            error: Some(proto::CommandError {
                request_id: 0,
                error: server_error as i32,
                message: e.message().to_string(),
            }),
            ..Default::default()
        },
        &[],
    );
    if e.kind() == ErrorKind::Auth || inner.refusal.lock().is_none() {
        *inner.refusal.lock() = Some(e);
    }
    let _ = client.write_all(&frame).await;
    let _ = client.shutdown().await;
}

/// TCP and TLS to the broker. The error says whether the broker was unreachable (its TCP
/// port refused or timed out until `connect_timeout`: worth trying again).
async fn connect_upstream(
    inner: &Inner,
    up: &Upstream,
) -> std::result::Result<UpstreamStream, (Error, bool)> {
    let server = up.to_string();
    // A refused or timed-out TCP connection is tried again, with a growing pause, until
    // `connect_timeout`, as the pulsar crate does on its own connections: failing the local
    // connection at once would have the crate's reconnect loops spin while a broker restarts.
    let deadline = tokio::time::Instant::now() + inner.connect_timeout;
    let mut pause = Duration::from_millis(100);
    let tcp = loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let e = match tokio::time::timeout(left, TcpStream::connect((up.host.as_str(), up.port)))
            .await
        {
            Ok(Ok(s)) => break s,
            Ok(Err(e)) => e,
            Err(_) => std::io::ErrorKind::TimedOut.into(),
        };
        let retriable = matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::TimedOut
        );
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if !retriable || left < pause {
            return Err((
                Error::new(
                    if e.kind() == std::io::ErrorKind::TimedOut {
                        ErrorKind::Timeout
                    } else {
                        ErrorKind::Connect
                    },
                    format!(
                        "cannot reach the Pulsar broker at {server} (tried for up to {} ms): {e}",
                        inner.connect_timeout.as_millis()
                    ),
                ),
                retriable,
            ));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    };
    let _ = tcp.set_nodelay(true);
    let Some(tls) = &inner.tls else {
        return Ok(Box::new(tcp));
    };
    let name = rustls::pki_types::ServerName::try_from(up.host.clone()).map_err(|e| {
        (
            Error::config(format!(
                "Pulsar at {server}: '{}' is not a host name for TLS: {e}",
                up.host
            )),
            false,
        )
    })?;
    match tokio::time::timeout(inner.connect_timeout, tls.connect(name, tcp)).await {
        Ok(Ok(s)) => Ok(Box::new(s)),
        Ok(Err(e)) => Err((refused_after_handshake(&inner.present, &server, &e), false)),
        Err(_) => Err((
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "no TLS handshake with the Pulsar broker at {server} within {} ms",
                    inner.connect_timeout.as_millis()
                ),
            ),
            false,
        )),
    }
}

/// The error of a failed TLS handshake, or of the first read or write after it: a refused
/// server certificate or an alert from the server (it refused our client certificate) is
/// `Auth`, the rest `Connect`.
/// (Also for onceflow's own broker connections, `wire.rs`.)
pub(crate) fn refused_after_handshake(
    present: &Present,
    server: &str,
    e: &std::io::Error,
) -> Error {
    match crate::auth::rustls_error(e) {
        Some(
            r @ (rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented),
        ) => crate::auth::certificate_error("Pulsar", server, r),
        Some(rustls::Error::AlertReceived(alert)) => Error::new(
            ErrorKind::Auth,
            match present {
                Present::ClientCert(_) => format!(
                    "Pulsar at {server} refused the TLS connection with {} (TLS alert \
                     {alert:?}): is it signed by a CA the broker trusts (its \
                     tlsTrustCertsFilePath), still valid, and made for client authentication?",
                    present.describe()
                ),
                Present::Credentials(..) => {
                    format!("Pulsar at {server} refused the TLS connection (TLS alert {alert:?})")
                }
            },
        ),
        _ => Error::new(
            ErrorKind::Connect,
            format!(
                "Pulsar at {server}: the TLS connection failed: {e} (is it the broker's TLS \
                 port, brokerServicePortTls, 6651 by default?)"
            ),
        ),
    }
}

/// Reads one whole frame (`[u32 totalSize]` and what follows) from `r`, keeping what follows
/// it in `buf`. `None` at end of stream before a frame started. With `max` up to
/// [`MAX_FIRST_FRAME`] (a local connection's first frame) nothing beyond the 4-byte size is
/// reserved before the size is read and checked.
async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
    max: usize,
) -> std::io::Result<Option<BytesMut>> {
    loop {
        if buf.len() >= 4 {
            let total = frame_size(buf, max)?;
            if buf.len() >= 4 + total {
                return Ok(Some(buf.split_to(4 + total)));
            }
            buf.reserve(4 + total - buf.len());
        } else if max <= MAX_FIRST_FRAME {
            buf.reserve(4 - buf.len());
        } else {
            buf.reserve(READ_CHUNK);
        }
        if r.read_buf(buf).await? == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(std::io::ErrorKind::UnexpectedEof.into())
            };
        }
    }
}

/// The `totalSize` of the frame at the start of `buf` (at least 4 bytes).
fn frame_size(buf: &[u8], max: usize) -> std::io::Result<usize> {
    let total = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if !(4..=max).contains(&total) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a Pulsar frame of {total} bytes (expected 4 to {max})"),
        ));
    }
    Ok(total)
}

/// The command bytes and the rest (payload) of a whole frame.
fn split_frame(frame: &[u8]) -> std::io::Result<(&[u8], &[u8])> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed Pulsar frame");
    let body = frame.get(4..).ok_or_else(bad)?;
    let size = body.get(..4).ok_or_else(bad)?;
    let size = u32::from_be_bytes([size[0], size[1], size[2], size[3]]) as usize;
    let cmd = body.get(4..4 + size).ok_or_else(bad)?;
    Ok((cmd, &body[4 + size..]))
}

/// A frame of `cmd` followed by `rest` (a payload part, as read).
fn encode_frame(cmd: &proto::BaseCommand, rest: &[u8]) -> Vec<u8> {
    let len = cmd.encoded_len();
    let mut out = Vec::with_capacity(8 + len + rest.len());
    out.extend_from_slice(&((4 + len + rest.len()) as u32).to_be_bytes());
    out.extend_from_slice(&(len as u32).to_be_bytes());
    cmd.encode(&mut out).expect("a Vec grows");
    out.extend_from_slice(rest);
    out
}

/// The command's type, read from its first field when it comes first (as every Pulsar
/// client and broker writes it), else by decoding the command. `None` if undecodable.
fn command_type(cmd: &[u8]) -> Option<i32> {
    if let Some((&0x08, mut rest)) = cmd.split_first() {
        if let Ok(t) = prost::encoding::decode_varint(&mut rest) {
            return i32::try_from(t).ok();
        }
    }
    proto::BaseCommand::decode(cmd).ok().map(|c| c.r#type)
}

/// The ERROR command of a frame, if it is one.
fn error_of(frame: &[u8]) -> Option<proto::CommandError> {
    let (cmd, _) = split_frame(frame).ok()?;
    if command_type(cmd)? != Type::Error as i32 {
        return None;
    }
    proto::BaseCommand::decode(cmd).ok()?.error
}

/// Checks a local connection's first frame: a `CONNECT` with [`MARKER`] and `secret` (compared
/// in constant time). Returns what makes it the frame for the broker, given the auth method
/// and data to present (`tls` and none with a client certificate), or why it is refused
/// (never quoting what was sent).
#[allow(clippy::type_complexity)]
fn check_connect(
    frame: &[u8],
    secret: &[u8; 32],
) -> std::result::Result<impl FnOnce(Option<String>, Option<Vec<u8>>) -> Vec<u8>, &'static str> {
    let (cmd, rest) = split_frame(frame).map_err(|_| "malformed frame")?;
    let mut command = proto::BaseCommand::decode(cmd).map_err(|_| "undecodable command")?;
    if command.r#type != Type::Connect as i32 {
        return Err("first command is not CONNECT");
    }
    let connect = command.connect.as_mut().ok_or("CONNECT without its body")?;
    if connect.auth_method_name.as_deref() != Some(MARKER) {
        return Err("CONNECT with another auth method");
    }
    let data = connect.auth_data.as_deref().unwrap_or_default();
    if data.len() != secret.len() || !bool::from(data.ct_eq(secret)) {
        return Err("CONNECT with a wrong secret");
    }
    if !rest.is_empty() {
        return Err("CONNECT with a payload");
    }
    connect.auth_data = None;
    connect.auth_method = None;
    // What only a Pulsar proxy sends on behalf of its client: never ours to claim.
    connect.original_principal = None;
    connect.original_auth_data = None;
    connect.original_auth_method = None;
    Ok(move |method: Option<String>, data: Option<Vec<u8>>| {
        if let Some(c) = command.connect.as_mut() {
            c.auth_method_name = method;
            c.auth_data = data;
        }
        encode_frame(&command, &[])
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// From the crate to the broker: `AUTH_RESPONSE` is rewritten.
    ToBroker,
    /// From the broker to the crate: `LOOKUP_RESPONSE` is rewritten.
    ToClient,
}

/// The frame rewritten for the other side, or `None` to pass it as it is.
async fn rewrite(
    inner: &Arc<Inner>,
    conn: &Mutex<ConnFrames>,
    dir: Direction,
    frame: &[u8],
) -> std::io::Result<Option<Vec<u8>>> {
    let (cmd, rest) = split_frame(frame)?;
    let Some(t) = command_type(cmd) else {
        return Ok(None);
    };
    if tracing::enabled!(target: "onceflow_pulsar::frames", tracing::Level::DEBUG) {
        trace_frame(conn, dir, t, cmd);
    }
    if let Some(txn) = &inner.txn {
        if txn.reads(t) {
            return txn.rewrite(conn, dir, cmd, rest);
        }
    }
    let invalid =
        |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    match dir {
        Direction::ToBroker if t == Type::AuthResponse as i32 => {
            let mut c = proto::BaseCommand::decode(cmd)
                .map_err(|_| invalid("undecodable AUTH_RESPONSE"))?;
            if let Some(r) = c.auth_response.as_mut() {
                let (method, data) = inner.present.auth().await.map_err(|e| {
                    std::io::Error::other(format!(
                        "no credential for the broker's AUTH_CHALLENGE: {e}"
                    ))
                })?;
                r.response = Some(proto::AuthData {
                    auth_method_name: method,
                    auth_data: Some(data.unwrap_or_default()),
                });
            }
            Ok(Some(encode_frame(&c, rest)))
        }
        Direction::ToBroker if t == Type::Connect as i32 => {
            Err(invalid("a second CONNECT on an established connection"))
        }
        Direction::ToClient if t == Type::LookupResponse as i32 => {
            let mut c = proto::BaseCommand::decode(cmd)
                .map_err(|_| invalid("undecodable LOOKUP_RESPONSE"))?;
            if let Some(r) = c.lookup_topic_response.as_mut() {
                rewrite_lookup(r, inner.tls.is_some(), |up| listen(inner, up))?;
                inner.lookups.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Some(encode_frame(&c, rest)))
        }
        _ => Ok(None),
    }
}

/// A message id as `ledger:entry[:batch index/batch size][ ack set]`, for [`trace_frame`].
fn show_id(id: &proto::MessageIdData) -> String {
    let mut s = format!("{}:{}", id.ledger_id, id.entry_id);
    if let Some(i) = id.batch_index.filter(|i| *i >= 0) {
        s.push_str(&format!(":{i}/{}", id.batch_size.unwrap_or(0)));
    }
    if !id.ack_set.is_empty() {
        s.push_str(&format!(" set={:x?}", id.ack_set));
    }
    s
}

/// Logs (target `onceflow_pulsar::frames`, debug) the consumer frames that decide what a
/// subscription delivers: `SUBSCRIBE`, `FLOW`, `MESSAGE`, `ACK`, `ACK_RESPONSE`,
/// `REDELIVER_UNACKNOWLEDGED_MESSAGES`, `CLOSE_CONSUMER`, with the connection's number.
fn trace_frame(conn: &Mutex<ConnFrames>, dir: Direction, t: i32, cmd: &[u8]) {
    const TRACED: [i32; 7] = [
        Type::Subscribe as i32,
        Type::Flow as i32,
        Type::Message as i32,
        Type::Ack as i32,
        Type::AckResponse as i32,
        Type::RedeliverUnacknowledgedMessages as i32,
        Type::CloseConsumer as i32,
    ];
    if !TRACED.contains(&t) {
        return;
    }
    let Ok(c) = proto::BaseCommand::decode(cmd) else {
        return;
    };
    let id = conn.lock().id;
    let ids = |v: &[proto::MessageIdData]| v.iter().map(show_id).collect::<Vec<_>>().join(",");
    let what = if let Some(s) = &c.subscribe {
        format!(
            "SUBSCRIBE consumer={} topic={} sub={} name={:?}",
            s.consumer_id, s.topic, s.subscription, s.consumer_name
        )
    } else if let Some(f) = &c.flow {
        format!(
            "FLOW consumer={} permits={}",
            f.consumer_id, f.message_permits
        )
    } else if let Some(m) = &c.message {
        format!(
            "MESSAGE consumer={} id={} redelivery={:?} ack_set={:x?}",
            m.consumer_id,
            show_id(&m.message_id),
            m.redelivery_count,
            m.ack_set
        )
    } else if let Some(a) = &c.ack {
        format!(
            "ACK consumer={} type={} ids=[{}] txn={:?}/{:?} request={:?}",
            a.consumer_id,
            a.ack_type,
            ids(&a.message_id),
            a.txnid_most_bits,
            a.txnid_least_bits,
            a.request_id
        )
    } else if let Some(r) = &c.ack_response {
        format!(
            "ACK_RESPONSE consumer={} request={:?} error={:?} {:?}",
            r.consumer_id, r.request_id, r.error, r.message
        )
    } else if let Some(r) = &c.redeliver_unacknowledged_messages {
        format!(
            "REDELIVER consumer={} ids=[{}]",
            r.consumer_id,
            ids(&r.message_ids)
        )
    } else if let Some(cl) = &c.close_consumer {
        format!("CLOSE_CONSUMER consumer={}", cl.consumer_id)
    } else {
        return;
    };
    tracing::debug!(target: "onceflow_pulsar::frames", conn = id, ?dir, "{what}");
}

/// Points a lookup answer at the bridge: `brokerServiceUrl` becomes the bridge listener of
/// the broker's address (its TLS address with `tls`; made by `listen`), or, through a Pulsar
/// proxy (`proxy_through_service_url`), the broker's `host:port` that the crate sends as
/// `proxy_to_broker_url` on the service URL. With `tls`, an answer without a TLS address
/// fails.
fn rewrite_lookup(
    r: &mut proto::CommandLookupTopicResponse,
    tls: bool,
    listen: impl FnOnce(Upstream) -> std::io::Result<SocketAddr>,
) -> std::io::Result<()> {
    use proto::command_lookup_topic_response::LookupType;
    let answered = r.response == Some(LookupType::Connect as i32)
        || r.response == Some(LookupType::Redirect as i32);
    if !answered {
        return Ok(());
    }
    let address = if tls {
        r.broker_service_url_tls.as_deref()
    } else {
        r.broker_service_url.as_deref()
    };
    let Some(up) = address.and_then(|a| Upstream::of_url(a, tls)) else {
        if !tls {
            r.response = Some(LookupType::Failed as i32);
            r.error = Some(proto::ServerError::UnknownError as i32);
            r.message = Some(format!(
                "the broker answered the lookup without a plaintext address it can be \
                 reached at (brokerServiceUrl: {})",
                r.broker_service_url.as_deref().unwrap_or("not given")
            ));
            r.broker_service_url = None;
            r.broker_service_url_tls = None;
            return Ok(());
        }
        r.response = Some(LookupType::Failed as i32);
        r.error = Some(proto::ServerError::UnknownError as i32);
        r.message = Some(format!(
            "the broker answered the lookup without a TLS address (brokerServiceUrlTls; \
             brokerServiceUrl is {}): a client certificate needs the broker's TLS listener \
             (brokerServicePortTls)",
            r.broker_service_url
                .as_deref()
                .unwrap_or("not given either")
        ));
        r.broker_service_url = None;
        r.broker_service_url_tls = None;
        return Ok(());
    };
    if r.proxy_through_service_url == Some(true) {
        r.broker_service_url = Some(format!("pulsar://{up}"));
    } else {
        let local = listen(up.clone())?;
        r.broker_service_url = Some(crate_url(local, &up));
    }
    r.broker_service_url_tls = None;
    Ok(())
}

/// Relays frames from `r` to `w` (starting with what `buf` holds), rewriting those
/// [`rewrite`] rewrites; the rest is written as read, several frames per write. Frames that
/// come on `inject` (the bridge's own, whole) are written between relayed frames as they
/// come.
async fn pump<R, W>(
    mut r: R,
    mut w: W,
    mut buf: BytesMut,
    mut inject: Option<tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>>,
    inner: &Arc<Inner>,
    conn: &Mutex<ConnFrames>,
    dir: Direction,
) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    loop {
        // Whole frames at the front of `buf` up to `end` pass as they are.
        let mut end = 0;
        while buf.len() - end >= 4 {
            let total = frame_size(&buf[end..], MAX_FRAME)?;
            if buf.len() - end < 4 + total {
                break;
            }
            let frame = &buf[end..end + 4 + total];
            match rewrite(inner, conn, dir, frame).await? {
                None => end += 4 + total,
                Some(new) => {
                    w.write_all(&buf[..end]).await?;
                    w.write_all(&new).await?;
                    let _ = buf.split_to(end + 4 + total);
                    end = 0;
                }
            }
        }
        if end > 0 {
            w.write_all(&buf[..end]).await?;
            let _ = buf.split_to(end);
        }
        w.flush().await?;
        if buf.len() >= 4 {
            let total = frame_size(&buf, MAX_FRAME)?;
            buf.reserve((4 + total).saturating_sub(buf.len()).max(READ_CHUNK / 4));
        }
        if buf.capacity() - buf.len() < READ_CHUNK / 4 {
            buf.reserve(READ_CHUNK);
        }
        // Only whole frames were written above, so a frame of the bridge's own fits here.
        // (`read_buf` is cancel safe: nothing is read when the other branch wins.)
        let read = match inject.as_mut() {
            Some(frames) => tokio::select! {
                biased;
                frame = frames.recv() => {
                    match frame {
                        Some(f) => w.write_all(&f).await?,
                        None => inject = None,
                    }
                    continue;
                }
                n = r.read_buf(&mut buf) => n?,
            },
            None => r.read_buf(&mut buf).await?,
        };
        if read == 0 {
            let _ = w.shutdown().await;
            return Ok(());
        }
    }
}

/// The rustls configuration of the bridge (and of the admin REST client) with a client
/// certificate: the public web PKI plus `trusted` (PEM) as roots, the certificate chain and
/// key of `cert`, and the broker certificate check `tls_hostname_verification` /
/// `tls_allow_insecure_connection` ask for. `Config` errors name the file and what was
/// expected, never a key's content.
pub(crate) fn client_config(
    cert: &TlsClientCert,
    trusted: Option<&[u8]>,
    hostname_verification: bool,
    allow_insecure: bool,
) -> Result<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(pem) = trusted {
        for c in CertificateDer::pem_slice_iter(pem) {
            let c = c.map_err(|e| Error::config(format!("tls_trust_certs: {e}")))?;
            roots
                .add(c)
                .map_err(|e| Error::config(format!("tls_trust_certs: {e}")))?;
        }
    }
    let chain = read_file("tls_cert_file", &cert.cert_file)?;
    let chain = CertificateDer::pem_slice_iter(&chain)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| {
            Error::config(format!(
                "tls_cert_file={}: not PEM certificates (expected -----BEGIN CERTIFICATE-----)",
                cert.cert_file.display()
            ))
        })?;
    if chain.is_empty() {
        return Err(Error::config(format!(
            "tls_cert_file={}: no certificate in it (expected PEM, -----BEGIN CERTIFICATE-----)",
            cert.cert_file.display()
        )));
    }
    // A certificate outside its validity is refused by the broker with a TLS alert that says
    // "CertificateExpired" even when it is not valid yet: say which, with its dates.
    if let Some((not_before, not_after)) = validity(&chain[0]) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        if now < not_before || now > not_after {
            return Err(Error::new(
                ErrorKind::Auth,
                format!(
                    "tls_cert_file={}: the certificate is {} (notBefore {}, notAfter {}; now {})",
                    cert.cert_file.display(),
                    if now < not_before {
                        "not valid yet"
                    } else {
                        "expired"
                    },
                    utc(not_before),
                    utc(not_after),
                    utc(now)
                ),
            ));
        }
    }
    let key_pem = zeroize::Zeroizing::new(read_file("tls_key_file", &cert.key_file)?);
    // The PEM error could quote a line of the file: not shown.
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| {
        Error::config(format!(
            "tls_key_file={}: no private key in it (expected an unencrypted PEM key: BEGIN \
             PRIVATE KEY, BEGIN RSA PRIVATE KEY or BEGIN EC PRIVATE KEY)",
            cert.key_file.display()
        ))
    })?;
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::config(format!("TLS: {e}")))?;
    let builder = if hostname_verification && !allow_insecure {
        builder.with_root_certificates(roots)
    } else {
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .map_err(|e| Error::config(format!("TLS: {e}")))?;
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Lenient {
                inner,
                any_name: !hostname_verification,
                any_certificate: allow_insecure,
            }))
    };
    builder.with_client_auth_cert(chain, key).map_err(|e| {
        let why = match e {
            rustls::Error::InconsistentKeys(_) => {
                "the key does not belong to the certificate".to_string()
            }
            other => other.to_string(),
        };
        Error::config(format!(
            "tls_cert_file={} with tls_key_file={}: {why}",
            cert.cert_file.display(),
            cert.key_file.display()
        ))
    })
}

/// One DER element: its tag, its content and what follows it.
fn der(buf: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = buf.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |a, b| (a << 8) | *b as usize);
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// Seconds since the Unix epoch of an X.509 `UTCTime` (tag 0x17, `YYMMDDHHMMSSZ`, years
/// 1950-2049) or `GeneralizedTime` (tag 0x18, `YYYYMMDDHHMMSSZ`), RFC 5280 4.1.2.5.
fn der_time(tag: u8, t: &[u8]) -> Option<i64> {
    let digits = t.strip_suffix(b"Z")?;
    if !digits.iter().all(u8::is_ascii_digit) {
        // Also keeps the slicing below on character boundaries.
        return None;
    }
    let digits = std::str::from_utf8(digits).ok()?;
    let (year, rest) = match (tag, digits.len()) {
        (0x17, 12) => {
            let yy: i64 = digits[..2].parse().ok()?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &digits[2..])
        }
        (0x18, 14) => (digits[..4].parse().ok()?, &digits[4..]),
        _ => return None,
    };
    let n = |i: usize| rest.get(i..i + 2)?.parse::<i64>().ok();
    let (month, day, h, m, sec) = (n(0)?, n(2)?, n(4)?, n(6)?, n(8)?);
    // Days from civil (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + m * 60 + sec)
}

/// A certificate's validity (`notBefore`, `notAfter`) in seconds since the Unix epoch, read
/// from its DER (RFC 5280 4.1); `None` if it cannot be read (the TLS stack then decides).
fn validity(cert: &[u8]) -> Option<(i64, i64)> {
    let (_, certificate, _) = der(cert)?;
    let (_, tbs, _) = der(certificate)?;
    let (tag, _, mut rest) = der(tbs)?;
    if tag != 0xa0 {
        // No explicit version: that element was the serial number.
        rest = der(tbs)?.2;
    } else {
        rest = der(rest)?.2; // serial number
    }
    let rest = der(rest)?.2; // signature algorithm
    let rest = der(rest)?.2; // issuer
    let (_, validity, _) = der(rest)?;
    let (t1, nb, rest) = der(validity)?;
    let (t2, na, _) = der(rest)?;
    Some((der_time(t1, nb)?, der_time(t2, na)?))
}

/// Seconds since the Unix epoch as `YYYY-MM-DD HH:MM:SS UTC`.
fn utc(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        tod / 3600,
        tod % 3600 / 60,
        tod % 60
    )
}

fn read_file(key: &str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path)
        .map_err(|e| Error::config(format!("cannot read {key}={}: {e}", path.display())))
}

/// The broker certificate check with `tls_hostname_verification=false` (any name, the chain
/// still verified) or `tls_allow_insecure_connection=true` (any certificate). Handshake
/// signatures are always checked.
#[derive(Debug)]
struct Lenient {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    any_name: bool,
    any_certificate: bool,
}

impl rustls::client::danger::ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> std::result::Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if self.any_certificate {
            return Ok(rustls::client::danger::ServerCertVerified::assertion());
        }
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) if self.any_name => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The commands the bridge reads and rewrites for transactions ([`TxnFrames`]).
const TXN_TYPES: [i32; 10] = [
    Type::Producer as i32,
    Type::ProducerSuccess as i32,
    Type::Send as i32,
    Type::SendReceipt as i32,
    Type::SendError as i32,
    Type::Subscribe as i32,
    Type::Ack as i32,
    Type::AckResponse as i32,
    Type::Message as i32,
    Type::CloseConsumer as i32,
];
/// Of [`TXN_TYPES`], those the resumed sequence ids alone need (without transactions the
/// consumers' frames are not decoded).
const SEQUENCE_TYPES: &[i32] = TXN_TYPES.split_at(5).0;

/// CRC-32C (Castagnoli), the checksum of a message's metadata and payload.
const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

/// The payload part of a `SEND` frame (`[0x0e01][u32 CRC-32C][u32 metadata size][metadata]
/// [payload]`) with the transaction's id in its `MessageMetadata` (`txnid_most_bits` /
/// `txnid_least_bits`) and the checksum made again: the broker's transaction buffer takes the
/// message by the command's id, but its dispatchers tell an aborted transaction's messages
/// by the id in the stored metadata, as Java's client writes both.
///
/// With `shift`, the metadata's sequence id moves by it too (see [`TxnFrames`]'s resumed
/// sequence ids).
fn with_txn_metadata(rest: &[u8], txn: Option<TxnId>, shift: u64) -> std::io::Result<Vec<u8>> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    if rest.len() < 10 || rest[..2] != [0x0e, 0x01] {
        return Err(bad("a SEND without a checksummed payload"));
    }
    let size = u32::from_be_bytes([rest[6], rest[7], rest[8], rest[9]]) as usize;
    let metadata = rest
        .get(10..10 + size)
        .ok_or_else(|| bad("a SEND whose metadata is cut short"))?;
    let payload = &rest[10 + size..];
    let mut m =
        proto::MessageMetadata::decode(metadata).map_err(|_| bad("undecodable MessageMetadata"))?;
    if let Some(txn) = txn {
        m.txnid_most_bits = Some(txn.most_bits);
        m.txnid_least_bits = Some(txn.least_bits);
    }
    m.sequence_id = m.sequence_id.wrapping_add(shift);
    if let Some(h) = m.highest_sequence_id.as_mut() {
        *h = h.wrapping_add(shift);
    }
    let len = m.encoded_len();
    let mut out = Vec::with_capacity(10 + len + payload.len());
    out.extend_from_slice(&[0x0e, 0x01, 0, 0, 0, 0]);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    m.encode(&mut out).expect("a Vec grows");
    out.extend_from_slice(payload);
    let crc = CRC32C.checksum(&out[6..]);
    out[2..6].copy_from_slice(&crc.to_be_bytes());
    Ok(out)
}

/// Most acknowledgements of ended transactions kept to be dropped ([`TxnFrames::end`]), and
/// most of the crate's copies of the bridge's own acknowledgements kept to be dropped
/// ([`TxnFrames::expect_acks`]).
const MAX_VOID_ACKS: usize = 1 << 20;

/// A map of at most [`MAX_VOID_ACKS`] entries: past the bound its least recently used entry
/// goes. Its entries wait for `ACK`s a crate consumer closed before writing them never sends,
/// so it needs a bound; emptying it whole would let the `ACK`s still on their way pass as
/// plain acknowledgements (of an aborted transaction: made permanent, the input lost).
struct Bounded<K: std::hash::Hash + Eq, V> {
    map: lru::LruCache<K, V>,
    max: usize,
}

impl<K: std::hash::Hash + Eq, V> Default for Bounded<K, V> {
    fn default() -> Self {
        Bounded::new(MAX_VOID_ACKS)
    }
}

impl<K: std::hash::Hash + Eq, V> Bounded<K, V> {
    fn new(max: usize) -> Self {
        // Unbounded to the crate (a bounded LruCache allocates its whole capacity at once);
        // `put` keeps the bound.
        Bounded {
            map: lru::LruCache::unbounded(),
            max,
        }
    }

    /// Inserts or replaces `k`, then drops the least recently used entries past the bound.
    fn put(&mut self, k: K, v: V) {
        self.map.put(k, v);
        while self.map.len() > self.max {
            self.map.pop_lru();
        }
    }
}

fn ack_key(topic: &str, subscription: &str, id: &proto::MessageIdData) -> AckKey {
    (
        topic.to_string(),
        subscription.to_string(),
        id.ledger_id,
        id.entry_id,
        id.batch_index.unwrap_or(-1),
    )
}

/// Request ids the bridge gives the acknowledgements it puts in a transaction: far above the
/// pulsar crate's own (a counter per client from 0), so their `ACK_RESPONSE`s are told apart.
const TXN_ACK_REQUEST_IDS: u64 = 1 << 62;

/// What one relayed connection's frames said about its producers and consumers: ids are per
/// connection.
#[derive(Default)]
pub(crate) struct ConnFrames {
    /// Producer id → producer name.
    producers: HashMap<u64, String>,
    /// `PRODUCER` request id → producer id, until its `PRODUCER_SUCCESS` names it.
    creating: HashMap<u64, u64>,
    /// Consumer id → (topic, subscription).
    consumers: HashMap<u64, (String, String)>,
    /// This connection's number in the process ([`NEXT_CONN`]).
    id: u64,
    /// Writes frames of the bridge's own to the broker on this connection, between the
    /// crate's (`None` without transactions).
    inject: Option<Inject>,
}

/// Numbers the relayed connections ([`ConnFrames::id`]).
static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// A connection's writer of frames of the bridge's own ([`ConnFrames::inject`]).
type Inject = tokio::sync::mpsc::UnboundedSender<Vec<u8>>;

/// A crate consumer as the broker knows it: its connection (number and writer) and its id
/// there, from its `SUBSCRIBE`.
struct Subscribed {
    conn: u64,
    consumer_id: u64,
    inject: Inject,
}

/// Acknowledgements sent in one transaction: message ids sent and answered, the first
/// refusal.
#[derive(Default)]
struct TxnAcks {
    sent: u64,
    answered: u64,
    error: Option<Error>,
}

/// An acknowledged message: (partition topic, subscription, ledger, entry, batch index or -1).
type AckKey = (String, String, u64, u64, i32);

#[derive(Default)]
struct TxnState {
    /// Producer name → the open transaction its `SEND`s belong to.
    producers: HashMap<String, TxnId>,
    /// Producer name → messages handed to its crate producers, and messages of its `SEND`s
    /// that passed, while it was bound to its current transaction ([`TxnFrames::handed`],
    /// [`TxnFrames::sends_passed`]).
    sends: HashMap<String, SendCount>,
    /// Producer name → a transaction that ended before all its `SEND`s passed
    /// ([`TxnFrames::sends_passed`] timed out), and how many messages of it are still to
    /// pass, until when: they are stamped with it when they do (the broker never delivers
    /// them), not sent without a transaction or in the name's next one. The crate fails a
    /// message not answered within its operation timeout, after which none of them can come.
    ///
    /// Messages handed outside any transaction that had not passed when the name was bound
    /// ([`TxnFrames::bind_producer`]: `begin`'s wait for them timed out) are queued the same
    /// way with no transaction: they pass plain, not in the transaction that began after them.
    late: HashMap<String, std::collections::VecDeque<(Option<TxnId>, u64, std::time::Instant)>>,
    /// Crate producer id → the crate's sequence id of each of its `SEND`s that passed and has
    /// no receipt yet → the transaction it was stamped with (`None`: none). The crate resends
    /// the `SEND`s without a receipt after a reconnect, with their sequence ids: a resend
    /// carries what its first copy carried (its transaction may have ended meanwhile, and the
    /// producer may be bound to the next one), and is not counted as passed again.
    stamped: HashMap<u64, std::collections::BTreeMap<u64, Option<TxnId>>>,
    /// Messages a transaction acknowledges whose `ACK` has not passed yet → the transaction.
    expected: HashMap<AckKey, TxnId>,
    /// Messages of transactions that ended before their `ACK` passed: dropped when it does
    /// (an aborted transaction's acknowledgement must not become a plain one).
    void: Bounded<AckKey, TxnId>,
    /// Messages (with the ack set asked for) whose transactional acknowledgement the bridge
    /// sent itself ([`TxnFrames::expect_acks`]) → how many of the crate's own `ACK`s of them
    /// are still to be dropped when they pass. The ack set is part of the key so that another
    /// acknowledgement of the same message id (a plain one of other messages of its batch)
    /// is never taken for the crate's copy.
    injected: Bounded<(AckKey, Vec<i64>), u32>,
    /// (partition topic, subscription) → the crate consumers subscribed to it, from their
    /// `SUBSCRIBE` until their `CLOSE_CONSUMER` or the end of their connection.
    subscribed: HashMap<(String, String), Vec<Subscribed>>,
    acks: HashMap<TxnId, TxnAcks>,
    /// Request ids of acknowledgements awaiting their answer → transaction and message ids.
    awaiting: HashMap<u64, (TxnId, u64)>,
    next_request: u64,
    /// Batches the broker delivered with an ack set (PIP-54, `CommandMessage.ack_set`: bit i
    /// clear = message i of the batch is acknowledged already), by (partition topic,
    /// subscription, ledger, entry). The pulsar crate ignores it and hands the application
    /// those messages too.
    delivered_ack_sets: HashMap<(String, String, u64, u64), Vec<i64>>,
}

/// What a producer bound to a transaction handed to the crate and what passed the bridge.
#[derive(Debug, Default, Clone, Copy)]
struct SendCount {
    handed: u64,
    passed: u64,
}

/// Most `SEND`s of one crate producer awaiting their receipt whose stamp is kept
/// ([`TxnState::stamped`]).
const MAX_STAMPED: usize = 1 << 16;

/// Most batches delivered with an ack set kept ([`TxnFrames::acknowledged_before`]).
const MAX_ACK_SETS: usize = 1 << 16;

/// Transactions put on the pulsar crate's frames (PIP-31's transactional send and
/// acknowledgement; the crate has neither): while a producer name is bound to an open
/// transaction, the bridge writes its id (`txnid_most_bits` / `txnid_least_bits`) into that
/// producer's `SEND`s (command and stored metadata) on their way to the broker. The messages
/// a transaction acknowledges ([`TxnFrames::expect_acks`], told before the consumer sends
/// their `ACK`s) are acknowledged in it by an `ACK` the bridge writes itself on the
/// subscribed consumer's connection, the crate's own `ACK`s of them being dropped as they
/// pass; where that consumer is not known, the crate's `ACK`s get the transaction's id
/// whenever they pass (the crate consumer writes them asynchronously), and once the
/// transaction ended without them they are dropped.
/// A transactional `ACK` also gets a request id of the bridge's: the broker answers it
/// (`ACK_RESPONSE`, which the crate would not expect), the bridge counts the answers, and the
/// transaction is committed only once every acknowledgement it sent was answered without
/// error ([`TxnFrames::acks_answered`]). Payloads and every other frame pass byte for byte.
///
/// **Resumed sequence ids** (PIP-6 broker deduplication): the pulsar crate starts every
/// producer's sequence ids at 0 and ignores the last one the broker stored for the producer's
/// name (`PRODUCER_SUCCESS`'s `last_sequence_id`), so a named producer of a restarted process
/// had its first messages dropped as duplicates. The bridge moves a named producer's sequence
/// ids past that one: it adds `last_sequence_id + 1`, taken at the crate producer's first
/// `PRODUCER_SUCCESS` and kept across its reconnects (so the crate's resends keep their ids),
/// to the `SEND`s (command and stored metadata) and takes it off the `SEND_RECEIPT`s and
/// `SEND_ERROR`s the crate matches them by.
#[derive(Default)]
pub(crate) struct TxnFrames {
    state: Mutex<TxnState>,
    answered: Notify,
    /// Woken when a bound producer's `SEND` passes ([`TxnFrames::sends_passed`]).
    passed: Notify,
    /// Producer id → what its sequence ids are moved by (the crate numbers producers once
    /// per process, and a crate producer keeps its id across reconnects).
    shifts: Mutex<HashMap<u64, u64>>,
    /// Transactions are on (`transactions=true`): producers are made transactional.
    transactions: bool,
}

impl std::fmt::Debug for TxnFrames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state.lock();
        f.debug_struct("TxnFrames")
            .field("producers", &st.producers.len())
            .field("expected_acks", &st.expected.len())
            .finish()
    }
}

impl TxnFrames {
    /// The frames of a connection, with transactions or only resumed sequence ids.
    pub(crate) fn new(transactions: bool) -> TxnFrames {
        TxnFrames {
            transactions,
            ..TxnFrames::default()
        }
    }

    /// The `SEND`s of the producers named `name` (one per partition) belong to `txn` from
    /// now on, until [`TxnFrames::end`].
    ///
    /// Messages the name handed to the crate outside a transaction that have not passed yet
    /// (`begin` flushes the crate's batches and waits for them first, at most `late_for`) are
    /// not the transaction's: they still pass without one, within `late_for`.
    pub(crate) fn bind_producer(&self, name: &str, txn: TxnId, late_for: Duration) {
        let mut st = self.state.lock();
        st.producers.insert(name.to_string(), txn);
        if let Some(c) = st.sends.insert(name.to_string(), SendCount::default()) {
            if c.passed < c.handed {
                let until = std::time::Instant::now() + late_for;
                st.late.entry(name.to_string()).or_default().push_back((
                    None,
                    c.handed - c.passed,
                    until,
                ));
            }
        }
    }

    /// The transactional producer named `name` exists: the messages it hands to the crate
    /// ([`TxnFrames::handed`]) and those of its `SEND`s that pass are counted from now on,
    /// until [`TxnFrames::forget_producer`].
    pub(crate) fn register_producer(&self, name: &str) {
        self.state.lock().sends.entry(name.to_string()).or_default();
    }

    /// The transactional producer named `name` is closed: its counts are forgotten.
    pub(crate) fn forget_producer(&self, name: &str) {
        let mut st = self.state.lock();
        if !st.producers.contains_key(name) {
            st.sends.remove(name);
        }
    }

    /// A producer named `name` handed one message to the crate: counted, so that a
    /// transaction ends only once its `SEND`s passed, and begins only once the `SEND`s handed
    /// before it (outside any transaction) passed.
    pub(crate) fn handed(&self, name: &str) {
        self.state
            .lock()
            .sends
            .entry(name.to_string())
            .or_default()
            .handed += 1;
    }

    /// Waits, at most `timeout`, until every message the producers named `name` handed to the
    /// crate since their binding to the current transaction passed the bridge in a `SEND`
    /// (stamped with that transaction). Returns whether they all did.
    ///
    /// A transaction's `SEND`s are stamped as they pass, and the crate writes them
    /// asynchronously (a batching producer holds them up to `batch_timeout_ms`): one passing
    /// after the transaction ended went out without a transaction, read by everyone, or in the
    /// producer's next transaction. So a transaction waits for this before the coordinator
    /// ends it, and stays bound meanwhile.
    pub(crate) async fn sends_passed(&self, name: &str, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let passed = self.passed.notified();
            tokio::pin!(passed);
            passed.as_mut().enable();
            {
                let st = self.state.lock();
                if st.sends.get(name).is_none_or(|c| c.passed >= c.handed) {
                    return true;
                }
            }
            if tokio::time::timeout_at(deadline, passed).await.is_err() {
                return false;
            }
        }
    }

    /// The `ACK`s of these messages of `subscription` on `topic` (a partition's full name)
    /// belong to `txn`; call before the consumer sends them.
    ///
    /// Where exactly one crate consumer of this process is subscribed to that subscription
    /// and topic, the bridge sends the transactional acknowledgement itself, now, as one
    /// `ACK` per message id (see [`TxnFrames::inject_acks`]) on that consumer's connection and
    /// with its consumer id, and drops the crate's own `ACK`s of them when they pass. The crate's consumer engine
    /// handles an acknowledgement only after every message the broker pushed before it was
    /// taken from it: behind a prefetched batch of 1000 messages that was ~40 ms per commit
    /// (P2). Otherwise (no such consumer, or several: which one holds the messages is not
    /// known here) the crate's `ACK`s get the transaction's id as they pass.
    pub(crate) fn expect_acks(
        &self,
        txn: TxnId,
        topic: &str,
        subscription: &str,
        ids: &[proto::MessageIdData],
    ) {
        let mut st = self.state.lock();
        st.acks.entry(txn).or_default();
        if ids.is_empty() {
            return;
        }
        if self.inject_acks(&mut st, txn, topic, subscription, ids) {
            return;
        }
        for id in ids {
            st.expected.insert(ack_key(topic, subscription, id), txn);
        }
    }

    /// Sends `ids`' acknowledgement in `txn` on the connection of the one crate consumer
    /// subscribed to `subscription` on `topic` (see [`TxnFrames::expect_acks`]); `false`
    /// when there is not exactly one (or its connection is gone).
    ///
    /// One `ACK` command per message id, each with its own request id: the broker (Pulsar
    /// 4.2, `Consumer.individualAckWithTransaction`) takes every message id of a command out
    /// of the consumer's pending acknowledgements also when its pending-ack handle refuses
    /// the command (`TransactionConflict` for one of them: "already acked before", "in
    /// pending ack status"), none of them acknowledged, and then ignores their
    /// `REDELIVER_UNACKNOWLEDGED_MESSAGES` (it redelivers only what is pending on the
    /// consumer): the batches named with a refused one never came again while the member
    /// stayed (#27, key_shared, a failing transform: ~1 run in 4 stalled). Alone in its
    /// command, an accepted acknowledgement is held by the transaction, and the abort that
    /// follows the refusal redelivers it (the broker redelivers an aborted transaction's
    /// acknowledged messages whatever the consumer holds).
    fn inject_acks(
        &self,
        st: &mut TxnState,
        txn: TxnId,
        topic: &str,
        subscription: &str,
        ids: &[proto::MessageIdData],
    ) -> bool {
        let key = (topic.to_string(), subscription.to_string());
        let Some(subs) = st.subscribed.get_mut(&key) else {
            return false;
        };
        subs.retain(|s| !s.inject.is_closed());
        let [sub] = subs.as_slice() else {
            if subs.is_empty() {
                st.subscribed.remove(&key);
            }
            return false;
        };
        let first = st.next_request + 1;
        let frames: Vec<Vec<u8>> = ids
            .iter()
            .zip(first..)
            .map(|(id, n)| {
                encode_frame(
                    &proto::BaseCommand {
                        r#type: Type::Ack as i32,
                        ack: Some(proto::CommandAck {
                            consumer_id: sub.consumer_id,
                            ack_type: proto::command_ack::AckType::Individual as i32,
                            message_id: vec![id.clone()],
                            txnid_most_bits: Some(txn.most_bits),
                            txnid_least_bits: Some(txn.least_bits),
                            request_id: Some(TXN_ACK_REQUEST_IDS + n),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                    &[],
                )
            })
            .collect();
        let inject = sub.inject.clone();
        let mut sent = 0u64;
        for frame in frames {
            if inject.send(frame).is_err() {
                break;
            }
            sent += 1;
        }
        if sent == 0 {
            return false;
        }
        // A connection gone after some were written: those are answered (or the transaction
        // times out waiting), the rest go by the crate's `ACK`s (`expected`).
        for n in first..first + sent {
            st.awaiting.insert(TXN_ACK_REQUEST_IDS + n, (txn, 1));
        }
        st.next_request += sent;
        st.acks.entry(txn).or_default().sent += sent;
        for id in &ids[sent as usize..] {
            st.expected.insert(ack_key(topic, subscription, id), txn);
        }
        for id in &ids[..sent as usize] {
            let k = (ack_key(&key.0, &key.1, id), id.ack_set.clone());
            let n = st.injected.map.get(&k).copied().unwrap_or(0);
            st.injected.put(k, n + 1);
        }
        true
    }

    /// Waits until at least `expected` message ids acknowledged in `txn` were sent and every
    /// one sent was answered, at most `timeout`. The broker's refusal of one of them
    /// (`TransactionConflict`: acknowledged in another transaction; the subscription's cursor
    /// moved past it) is its error (`Aborted`); `Timeout` when the answers did not come.
    pub(crate) async fn acks_answered(
        &self,
        txn: TxnId,
        expected: u64,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.answered.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.state.lock();
                let a = st.acks.entry(txn).or_default();
                if let Some(e) = a.error.take() {
                    return Err(e);
                }
                if a.sent >= expected && a.answered >= a.sent {
                    return Ok(());
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let st = self.state.lock();
                let a = st.acks.get(&txn);
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the acknowledgements of Pulsar transaction {txn} were not all answered \
                         within {} ms ({} of {} message ids sent, {} answered)",
                        timeout.as_millis(),
                        a.map_or(0, |a| a.sent),
                        expected,
                        a.map_or(0, |a| a.answered)
                    ),
                )
                .retriable(true));
            }
        }
    }

    /// `txn` ended: its producer is unbound, the `ACK`s it still expected are dropped when
    /// they pass, its counts are forgotten.
    ///
    /// Messages its producers handed to the crate that have not passed yet
    /// ([`TxnFrames::sends_passed`] timed out) still get `txn` when they pass within `late_for`.
    pub(crate) fn end(&self, txn: TxnId, late_for: Duration) {
        let mut st = self.state.lock();
        Self::unbind_locked(&mut st, txn, late_for);
        let late: Vec<AckKey> = st
            .expected
            .iter()
            .filter(|(_, t)| **t == txn)
            .map(|(k, _)| k.clone())
            .collect();
        for k in late {
            st.expected.remove(&k);
            st.void.put(k, txn);
        }
        st.acks.remove(&txn);
        st.awaiting.retain(|_, (t, _)| *t != txn);
    }

    /// The producer names bound to `txn` are unbound now (a dropped transaction, whose abort
    /// runs in the background): what they hand to the crate from now on is sent without it,
    /// and their messages of `txn` not passed yet still get it when they pass (within
    /// `late_for`, before the later ones: [`TxnFrames::late_passed`]). Its acknowledgements
    /// are left to [`TxnFrames::end`].
    pub(crate) fn unbind(&self, txn: TxnId, late_for: Duration) {
        Self::unbind_locked(&mut self.state.lock(), txn, late_for);
    }

    /// The transaction a producer's `SEND` of `n` messages named `name` goes in, the first
    /// time it passes: the crate writes a producer's `SEND`s in the order the messages were
    /// handed to it, so an ended transaction's late ones come first (and messages handed
    /// outside a transaction before the name was bound pass plain), then the transaction the
    /// name is bound to.
    fn first_send_txn(&self, st: &mut TxnState, name: &str, n: u64) -> Option<TxnId> {
        let now = std::time::Instant::now();
        let late = st.late.get_mut(name).and_then(|q| {
            while q.front().is_some_and(|l| l.2 < now) {
                q.pop_front();
            }
            let front = q.front_mut()?;
            let txn = front.0;
            front.1 = front.1.saturating_sub(n);
            if front.1 == 0 {
                q.pop_front();
            }
            Some(txn)
        });
        if st.late.get(name).is_some_and(|q| q.is_empty()) {
            st.late.remove(name);
        }
        if let Some(txn) = late {
            self.passed.notify_waiters();
            txn
        } else {
            if let Some(c) = st.sends.get_mut(name) {
                c.passed += n;
            }
            self.passed.notify_waiters();
            st.producers.get(name).copied()
        }
    }

    /// Whether messages of an ended transaction of the producer named `name` are still to
    /// pass ([`TxnFrames::unbind`]).
    pub(crate) fn late_pending(&self, name: &str) -> bool {
        let now = std::time::Instant::now();
        self.state
            .lock()
            .late
            .get(name)
            .is_some_and(|q| q.iter().any(|l| l.0.is_some() && l.1 > 0 && l.2 >= now))
    }

    /// Waits, at most `timeout`, until no message of an ended transaction of the producer
    /// named `name` is still to pass. Returns whether none is.
    pub(crate) async fn late_passed(&self, name: &str, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let passed = self.passed.notified();
            tokio::pin!(passed);
            passed.as_mut().enable();
            if !self.late_pending(name) {
                return true;
            }
            if tokio::time::timeout_at(deadline, passed).await.is_err() {
                return false;
            }
        }
    }

    fn unbind_locked(st: &mut TxnState, txn: TxnId, late_for: Duration) {
        let mut unbound = Vec::new();
        st.producers.retain(|n, t| {
            let keep = *t != txn;
            if !keep {
                unbound.push(n.clone());
            }
            keep
        });
        for n in unbound {
            // Counted on from zero: what the name hands outside a transaction from now on.
            if let Some(c) = st.sends.get_mut(&n).map(std::mem::take) {
                if c.passed < c.handed {
                    let until = std::time::Instant::now() + late_for;
                    st.late.entry(n).or_default().push_back((
                        Some(txn),
                        c.handed - c.passed,
                        until,
                    ));
                }
            }
        }
    }

    /// Whether the broker delivered message `id` of a batch (on `topic`, a partition's full
    /// name, for `subscription`) marked as acknowledged already: its bit is clear in the ack
    /// set the entry last came with (another member, or a transaction of this one,
    /// acknowledged it before the entry came again). Java's client skips such messages.
    pub(crate) fn acknowledged_before(
        &self,
        topic: &dyn Fn() -> String,
        subscription: &str,
        id: &proto::MessageIdData,
    ) -> bool {
        let Some(index) = id.batch_index.filter(|i| *i >= 0) else {
            return false;
        };
        let st = self.state.lock();
        if st.delivered_ack_sets.is_empty() {
            return false;
        }
        let key = (topic(), subscription.to_string(), id.ledger_id, id.entry_id);
        st.delivered_ack_sets.get(&key).is_some_and(|set| {
            let i = index as usize;
            set.get(i / 64)
                .is_some_and(|w| (*w as u64) & (1 << (i % 64)) == 0)
        })
    }

    /// Whether frames of type `t` are read here: [`TXN_TYPES`] with transactions, else
    /// [`SEQUENCE_TYPES`].
    fn reads(&self, t: i32) -> bool {
        if self.transactions {
            TXN_TYPES.contains(&t)
        } else {
            SEQUENCE_TYPES.contains(&t)
        }
    }

    /// What the sequence ids of producer `id` move by (0: not at all).
    fn shift(&self, id: u64) -> u64 {
        self.shifts.lock().get(&id).copied().unwrap_or(0)
    }

    /// Reads (and for `SEND` and `ACK` in a transaction, rewrites) a frame of [`TXN_TYPES`].
    fn rewrite(
        &self,
        conn: &Mutex<ConnFrames>,
        dir: Direction,
        cmd: &[u8],
        rest: &[u8],
    ) -> std::io::Result<Option<Vec<u8>>> {
        let invalid = |what: &str| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("undecodable {what}"),
            )
        };
        let mut c = proto::BaseCommand::decode(cmd).map_err(|_| invalid("command"))?;
        if let Some(close) = &c.close_consumer {
            // Closed by the crate or by the broker: no longer one to acknowledge through.
            let id = conn.lock().id;
            let mut st = self.state.lock();
            st.subscribed.retain(|_, subs| {
                subs.retain(|s| (s.conn, s.consumer_id) != (id, close.consumer_id));
                !subs.is_empty()
            });
            return Ok(None);
        }
        match dir {
            Direction::ToBroker => {
                if let Some(p) = c.producer.as_mut() {
                    {
                        let mut conn = conn.lock();
                        if let Some(name) = &p.producer_name {
                            conn.producers.insert(p.producer_id, name.clone());
                        }
                        conn.creating.insert(p.request_id, p.producer_id);
                    }
                    if !self.transactions {
                        return Ok(None);
                    }
                    // As Java's client with `enableTransaction` creates every producer: the
                    // broker takes transactional sends only from producers made so.
                    p.txn_enabled = Some(true);
                    return Ok(Some(encode_frame(&c, rest)));
                }
                if let Some(sub) = &c.subscribe {
                    let inject = {
                        let mut conn = conn.lock();
                        conn.consumers.insert(
                            sub.consumer_id,
                            (sub.topic.clone(), sub.subscription.clone()),
                        );
                        conn.inject.clone().map(|i| (conn.id, i))
                    };
                    if let Some((id, inject)) = inject {
                        let mut st = self.state.lock();
                        let subs = st
                            .subscribed
                            .entry((sub.topic.clone(), sub.subscription.clone()))
                            .or_default();
                        subs.retain(|s| {
                            !s.inject.is_closed()
                                && (s.conn, s.consumer_id) != (id, sub.consumer_id)
                        });
                        subs.push(Subscribed {
                            conn: id,
                            consumer_id: sub.consumer_id,
                            inject,
                        });
                    }
                    return Ok(None);
                }
                if let Some(send) = c.send.as_mut() {
                    let txn = match conn.lock().producers.get(&send.producer_id) {
                        Some(name) => {
                            let n = send.num_messages.unwrap_or(1).max(1) as u64;
                            let mut st = self.state.lock();
                            let resent = st
                                .stamped
                                .get(&send.producer_id)
                                .and_then(|m| m.get(&send.sequence_id))
                                .copied();
                            match resent {
                                // A resend after a reconnect: as its first copy.
                                Some(first) => first,
                                None => {
                                    let txn = self.first_send_txn(&mut st, name, n);
                                    let m = st.stamped.entry(send.producer_id).or_default();
                                    if m.len() >= MAX_STAMPED {
                                        m.pop_first();
                                    }
                                    m.insert(send.sequence_id, txn);
                                    txn
                                }
                            }
                        }
                        None => return Ok(None),
                    };
                    let shift = self.shift(send.producer_id);
                    if txn.is_none() && shift == 0 {
                        return Ok(None);
                    }
                    if let Some(txn) = txn {
                        send.txnid_most_bits = Some(txn.most_bits);
                        send.txnid_least_bits = Some(txn.least_bits);
                    }
                    send.sequence_id = send.sequence_id.wrapping_add(shift);
                    if let Some(h) = send.highest_sequence_id.as_mut() {
                        *h = h.wrapping_add(shift);
                    }
                    let rest = with_txn_metadata(rest, txn, shift)?;
                    return Ok(Some(encode_frame(&c, &rest)));
                }
                if let Some(ack) = c.ack.as_mut() {
                    let Some((topic, sub)) = conn.lock().consumers.get(&ack.consumer_id).cloned()
                    else {
                        return Ok(None);
                    };
                    let mut st = self.state.lock();
                    let keys: Vec<AckKey> = ack
                        .message_id
                        .iter()
                        .map(|id| ack_key(&topic, &sub, id))
                        .collect();
                    if !st.injected.map.is_empty() {
                        let copies: Vec<(AckKey, Vec<i64>)> = keys
                            .iter()
                            .zip(&ack.message_id)
                            .map(|(k, id)| (k.clone(), id.ack_set.clone()))
                            .collect();
                        if !copies.is_empty() && copies.iter().all(|k| st.injected.map.contains(k))
                        {
                            for k in &copies {
                                if let Some(n) = st.injected.map.get_mut(k) {
                                    *n -= 1;
                                    if *n == 0 {
                                        st.injected.map.pop(k);
                                    }
                                }
                            }
                            // Sent by the bridge in its transaction already (`expect_acks`).
                            return Ok(Some(Vec::new()));
                        }
                    }
                    if !keys.is_empty() && keys.iter().all(|k| st.void.map.contains(k)) {
                        for k in &keys {
                            st.void.map.pop(k);
                        }
                        // Of a transaction that ended without it: never a plain ack.
                        return Ok(Some(Vec::new()));
                    }
                    let Some(txn) = keys.first().and_then(|k| st.expected.get(k).copied()) else {
                        return Ok(None);
                    };
                    for k in &keys {
                        st.expected.remove(k);
                    }
                    let ids = ack.message_id.len() as u64;
                    st.next_request += 1;
                    let id = TXN_ACK_REQUEST_IDS + st.next_request;
                    st.awaiting.insert(id, (txn, ids));
                    st.acks.entry(txn).or_default().sent += ids;
                    ack.txnid_most_bits = Some(txn.most_bits);
                    ack.txnid_least_bits = Some(txn.least_bits);
                    ack.request_id = Some(id);
                    return Ok(Some(encode_frame(&c, rest)));
                }
                Ok(None)
            }
            Direction::ToClient => {
                if let Some(m) = &c.message {
                    // The entry's latest delivery decides: one without an ack set (after a
                    // seek, say) has nothing acknowledged.
                    if m.ack_set.is_empty() && self.state.lock().delivered_ack_sets.is_empty() {
                        return Ok(None);
                    }
                    let sub = conn.lock().consumers.get(&m.consumer_id).cloned();
                    if let Some((topic, sub)) = sub {
                        let id = &m.message_id;
                        let key = (topic, sub, id.ledger_id, id.entry_id);
                        let mut st = self.state.lock();
                        if m.ack_set.is_empty() {
                            st.delivered_ack_sets.remove(&key);
                        } else {
                            if st.delivered_ack_sets.len() >= MAX_ACK_SETS {
                                st.delivered_ack_sets.clear();
                            }
                            st.delivered_ack_sets.insert(key, m.ack_set.clone());
                        }
                    }
                    return Ok(None);
                }
                if let Some(ok) = &c.producer_success {
                    let mut conn = conn.lock();
                    if let Some(producer_id) = conn.creating.remove(&ok.request_id) {
                        conn.producers.insert(producer_id, ok.producer_name.clone());
                        if let Some(last) = ok.last_sequence_id.filter(|l| *l >= 0) {
                            // The first answer of this crate producer decides; a reconnect's
                            // (which counts our own sends) does not move it again.
                            self.shifts
                                .lock()
                                .entry(producer_id)
                                .or_insert(last as u64 + 1);
                        }
                    }
                    return Ok(None);
                }
                let (receipt, error) = (c.send_receipt.as_mut(), c.send_error.as_mut());
                if receipt.is_some() || error.is_some() {
                    let producer_id = receipt
                        .as_ref()
                        .map(|r| r.producer_id)
                        .or(error.as_ref().map(|e| e.producer_id))
                        .unwrap_or_default();
                    let shift = self.shift(producer_id);
                    {
                        // Answered: the crate resends it no more.
                        let mut st = self.state.lock();
                        if let Some(m) = st.stamped.get_mut(&producer_id) {
                            match (&receipt, &error) {
                                (Some(r), _) => {
                                    let rest =
                                        m.split_off(&(r.sequence_id.wrapping_sub(shift) + 1));
                                    *m = rest;
                                }
                                (None, Some(e)) => {
                                    m.remove(&e.sequence_id.wrapping_sub(shift));
                                }
                                (None, None) => {}
                            }
                            if m.is_empty() {
                                st.stamped.remove(&producer_id);
                            }
                        }
                    }
                    if shift == 0 {
                        return Ok(None);
                    }
                    if let Some(r) = receipt {
                        r.sequence_id = r.sequence_id.wrapping_sub(shift);
                        if let Some(h) = r.highest_sequence_id.as_mut() {
                            *h = h.wrapping_sub(shift);
                        }
                    }
                    if let Some(e) = error {
                        e.sequence_id = e.sequence_id.wrapping_sub(shift);
                    }
                    return Ok(Some(encode_frame(&c, rest)));
                }
                if let Some(r) = &c.ack_response {
                    let Some(id) = r.request_id.filter(|id| *id > TXN_ACK_REQUEST_IDS) else {
                        return Ok(None);
                    };
                    let mut st = self.state.lock();
                    if let Some((txn, ids)) = st.awaiting.remove(&id) {
                        let a = st.acks.entry(txn).or_default();
                        a.answered += ids;
                        if let Some(code) = r.error {
                            if a.error.is_none() {
                                a.error = Some(crate::wire::server_error(
                                    "the broker",
                                    &format!("an acknowledgement in transaction {txn}"),
                                    code,
                                    r.message.as_deref().unwrap_or_default(),
                                ));
                            }
                        }
                        drop(st);
                        self.answered.notify_waiters();
                    }
                    // The crate asked for no answer: it never sees this one.
                    return Ok(Some(Vec::new()));
                }
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bounded_map_drops_its_oldest_entry_never_the_whole_map() {
        let mut m: Bounded<u32, u32> = Bounded::new(3);
        for k in 0..3 {
            m.put(k, k);
        }
        // 0 is read (as the crate's copy of an ACK passing): 1 is now the oldest.
        assert_eq!(m.map.get(&0), Some(&0));
        m.put(3, 3);
        assert_eq!(m.map.len(), 3);
        assert!(!m.map.contains(&1), "the least recently used entry goes");
        for k in [0, 2, 3] {
            assert!(m.map.contains(&k), "{k} kept");
        }
    }

    fn connect_frame(method: Option<&str>, data: Option<Vec<u8>>) -> Vec<u8> {
        encode_frame(
            &proto::BaseCommand {
                r#type: Type::Connect as i32,
                connect: Some(proto::CommandConnect {
                    client_version: "test".to_string(),
                    auth_method_name: method.map(String::from),
                    auth_data: data,
                    protocol_version: Some(12),
                    proxy_to_broker_url: Some("10.0.0.1:6651".to_string()),
                    original_principal: Some("admin".to_string()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        )
    }

    #[test]
    fn connect_needs_the_marker_and_the_secret_and_is_rewritten_to_tls() {
        let secret = [7u8; 32];
        let ok = check_connect(&connect_frame(Some(MARKER), Some(secret.to_vec())), &secret)
            .unwrap_or_else(|why| panic!("{why}"))(Some("tls".to_string()), None);
        let (cmd, rest) = split_frame(&ok).unwrap();
        assert!(rest.is_empty());
        let c = proto::BaseCommand::decode(cmd).unwrap().connect.unwrap();
        assert_eq!(c.auth_method_name.as_deref(), Some("tls"));
        assert_eq!(c.auth_data, None);
        assert_eq!(c.original_principal, None);
        // What the crate asked for otherwise is kept (a proxy's broker).
        assert_eq!(c.proxy_to_broker_url.as_deref(), Some("10.0.0.1:6651"));
        assert_eq!(c.client_version, "test");

        let mut wrong = secret;
        wrong[31] ^= 1;
        for (frame, why) in [
            (
                connect_frame(Some(MARKER), Some(wrong.to_vec())),
                "CONNECT with a wrong secret",
            ),
            (
                connect_frame(Some(MARKER), Some(secret[..31].to_vec())),
                "CONNECT with a wrong secret",
            ),
            (
                connect_frame(Some(MARKER), None),
                "CONNECT with a wrong secret",
            ),
            (
                connect_frame(Some("tls"), Some(secret.to_vec())),
                "CONNECT with another auth method",
            ),
            (
                connect_frame(None, None),
                "CONNECT with another auth method",
            ),
            (
                encode_frame(
                    &proto::BaseCommand {
                        r#type: Type::Ping as i32,
                        ping: Some(proto::CommandPing {}),
                        ..Default::default()
                    },
                    &[],
                ),
                "first command is not CONNECT",
            ),
            (b"\0\0\0\x02ab".to_vec(), "malformed frame"),
        ] {
            match check_connect(&frame, &secret) {
                Err(refused) => assert_eq!(refused, why),
                Ok(_) => panic!("taken: {why}"),
            }
        }
    }

    fn lookup(tls: Option<&str>, proxy: bool) -> proto::CommandLookupTopicResponse {
        proto::CommandLookupTopicResponse {
            broker_service_url: Some("pulsar://broker-2.example:6650".to_string()),
            broker_service_url_tls: tls.map(String::from),
            response: Some(proto::command_lookup_topic_response::LookupType::Connect as i32),
            request_id: 9,
            authoritative: Some(true),
            proxy_through_service_url: Some(proxy),
            ..Default::default()
        }
    }

    #[test]
    fn lookups_point_at_a_bridge_listener_of_the_tls_address() {
        let local: SocketAddr = "127.0.0.1:40001".parse().unwrap();
        let mut asked = None;
        let mut r = lookup(Some("pulsar+ssl://broker-2.example:6651"), false);
        rewrite_lookup(&mut r, true, |up| {
            asked = Some(up);
            Ok(local)
        })
        .unwrap();
        assert_eq!(
            asked,
            Some(Upstream {
                host: "broker-2.example".to_string(),
                port: 6651
            })
        );
        assert_eq!(
            r.broker_service_url.as_deref(),
            Some("pulsar://127.0.0.1:40001/mtls-bridge-to/broker-2.example:6651")
        );
        assert_eq!(r.broker_service_url_tls, None);
        assert_eq!(r.request_id, 9);

        // Through a Pulsar proxy: no listener; the crate stays on the service URL (the bridge)
        // and names the broker's TLS address as proxy_to_broker_url.
        let mut r = lookup(Some("pulsar+ssl://[::1]:7651"), true);
        rewrite_lookup(&mut r, true, |_| panic!("no listener for a proxied lookup")).unwrap();
        assert_eq!(r.broker_service_url.as_deref(), Some("pulsar://[::1]:7651"));
        assert_eq!(r.proxy_through_service_url, Some(true));

        // No TLS address: the lookup fails instead of sending the crate to plaintext.
        let mut r = lookup(None, false);
        rewrite_lookup(&mut r, true, |_| panic!("no listener")).unwrap();
        assert_eq!(
            r.response,
            Some(proto::command_lookup_topic_response::LookupType::Failed as i32)
        );
        assert_eq!(r.broker_service_url, None);
        assert!(r.message.unwrap().contains("brokerServiceUrlTls"));

        // A failed lookup passes as it is.
        let mut r = lookup(None, false);
        r.response = Some(proto::command_lookup_topic_response::LookupType::Failed as i32);
        let before = r.clone();
        rewrite_lookup(&mut r, true, |_| panic!("no listener")).unwrap();
        assert_eq!(r, before);
    }

    fn inner() -> Arc<Inner> {
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
        Arc::new(Inner {
            tls: Some(tokio_rustls::TlsConnector::from(Arc::new(config))),
            txn: None,
            secret: [1; 32],
            present: Present::ClientCert("/c.pem".to_string()),
            connect_timeout: Duration::from_secs(1),
            listeners: Mutex::new(HashMap::new()),
            refusal: Mutex::new(None),
            stop: CancellationToken::new(),
            relayed: AtomicU64::new(0),
            refused_local: AtomicU64::new(0),
            lookups: AtomicU64::new(0),
            awaiting: Mutex::new(VecDeque::new()),
            next_local: AtomicU64::new(0),
            open: AtomicUsize::new(0),
            ended: Notify::new(),
        })
    }

    #[tokio::test]
    async fn auth_responses_lose_the_secret_and_other_frames_pass() {
        let inner = inner();
        let response = encode_frame(
            &proto::BaseCommand {
                r#type: Type::AuthResponse as i32,
                auth_response: Some(proto::CommandAuthResponse {
                    client_version: Some("c".to_string()),
                    response: Some(proto::AuthData {
                        auth_method_name: Some(MARKER.to_string()),
                        auth_data: Some(vec![1; 32]),
                    }),
                    protocol_version: Some(12),
                }),
                ..Default::default()
            },
            &[],
        );
        let out = rewrite(
            &inner,
            &Mutex::new(ConnFrames::default()),
            Direction::ToBroker,
            &response,
        )
        .await
        .unwrap()
        .unwrap();
        let (cmd, _) = split_frame(&out).unwrap();
        let r = proto::BaseCommand::decode(cmd)
            .unwrap()
            .auth_response
            .unwrap()
            .response
            .unwrap();
        assert_eq!(r.auth_method_name.as_deref(), Some("tls"));
        assert_eq!(r.auth_data, Some(Vec::new()));
        // A second CONNECT ends the connection; a payload frame passes as it is.
        let connect = connect_frame(Some(MARKER), Some(vec![1; 32]));
        assert!(rewrite(
            &inner,
            &Mutex::new(ConnFrames::default()),
            Direction::ToBroker,
            &connect
        )
        .await
        .is_err());
        let send = encode_frame(
            &proto::BaseCommand {
                r#type: Type::Send as i32,
                ..Default::default()
            },
            b"payload",
        );
        assert!(rewrite(
            &inner,
            &Mutex::new(ConnFrames::default()),
            Direction::ToBroker,
            &send
        )
        .await
        .unwrap()
        .is_none());
        assert!(rewrite(
            &inner,
            &Mutex::new(ConnFrames::default()),
            Direction::ToClient,
            &send
        )
        .await
        .unwrap()
        .is_none());
    }

    #[tokio::test]
    async fn lookup_answers_get_one_listener_per_broker() {
        let inner = inner();
        let answer = |tls: &str| {
            encode_frame(
                &proto::BaseCommand {
                    r#type: Type::LookupResponse as i32,
                    lookup_topic_response: Some(lookup(Some(tls), false)),
                    ..Default::default()
                },
                &[],
            )
        };
        let url_of = |frame: Vec<u8>| {
            let (cmd, _) = split_frame(&frame).unwrap();
            proto::BaseCommand::decode(cmd)
                .unwrap()
                .lookup_topic_response
                .unwrap()
                .broker_service_url
                .unwrap()
        };
        let a1 = url_of(
            rewrite(
                &inner,
                &Mutex::new(ConnFrames::default()),
                Direction::ToClient,
                &answer("pulsar+ssl://a.example:6651"),
            )
            .await
            .unwrap()
            .unwrap(),
        );
        let a2 = url_of(
            rewrite(
                &inner,
                &Mutex::new(ConnFrames::default()),
                Direction::ToClient,
                &answer("pulsar+ssl://a.example:6651"),
            )
            .await
            .unwrap()
            .unwrap(),
        );
        let b = url_of(
            rewrite(
                &inner,
                &Mutex::new(ConnFrames::default()),
                Direction::ToClient,
                &answer("pulsar+ssl://b.example:6651"),
            )
            .await
            .unwrap()
            .unwrap(),
        );
        assert!(a1.starts_with("pulsar://127.0.0.1:"), "{a1}");
        assert_eq!(a1, a2);
        assert_ne!(a1, b);
        assert_eq!(inner.listeners.lock().len(), 2);
        assert_eq!(inner.lookups.load(Ordering::Relaxed), 3);
        inner.stop.cancel();
    }

    #[tokio::test]
    async fn a_refused_broker_port_is_tried_again_until_the_timeout() {
        let inner = inner();
        // A port nothing listens on (bound, then closed).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let t0 = std::time::Instant::now();
        let Err((e, unreachable)) = connect_upstream(
            &inner,
            &Upstream {
                host: "127.0.0.1".to_string(),
                port,
            },
        )
        .await
        else {
            panic!("nothing listens there");
        };
        let took = t0.elapsed();
        assert_eq!(e.kind(), ErrorKind::Connect, "{e}");
        assert!(unreachable, "{e}");
        assert!(e.message().contains(&format!("127.0.0.1:{port}")), "{e}");
        // Tried with pauses of 100, 200, 400 ms within the 1 s timeout, not failed at once.
        assert!(took >= Duration::from_millis(600), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
    }

    #[test]
    fn certificate_validity_is_read_from_its_der() {
        fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
            let mut v = vec![tag, content.len() as u8];
            v.extend_from_slice(content);
            v
        }
        let times = [tlv(0x17, b"300101000000Z"), tlv(0x18, b"20310203040506Z")].concat();
        let tbs = [
            tlv(0xa0, &tlv(0x02, &[2])),
            tlv(0x02, &[1]),
            tlv(0x30, &[]),
            tlv(0x30, &[]),
            tlv(0x30, &times),
        ]
        .concat();
        let cert = tlv(0x30, &tlv(0x30, &tbs));
        let (nb, na) = validity(&cert).unwrap();
        assert_eq!(nb, 1_893_456_000);
        assert_eq!(utc(nb), "2030-01-01 00:00:00 UTC");
        assert_eq!(utc(na), "2031-02-03 04:05:06 UTC");
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert!(validity(&[0x30, 0x05, 1]).is_none());
        // A non-ASCII byte in a time field is no time, not a panic on a char boundary.
        assert_eq!(der_time(0x17, "3é010100000Z".as_bytes()), None);
        assert_eq!(der_time(0x18, "203é020304050Z".as_bytes()), None);
    }

    #[tokio::test]
    async fn a_first_frame_reserves_nothing_before_its_size_and_is_capped() {
        use tokio::io::AsyncWriteExt;
        let (mut a, mut b) = tokio::io::duplex(MAX_FIRST_FRAME);
        a.write_all(&((MAX_FIRST_FRAME + 1) as u32).to_be_bytes())
            .await
            .unwrap();
        let mut buf = BytesMut::new();
        let e = read_frame(&mut b, &mut buf, MAX_FIRST_FRAME)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert!(buf.capacity() < 64, "reserved {}", buf.capacity());
        // A CONNECT as the crate sends it fits.
        let f = connect_frame(Some(MARKER), Some(vec![9; 32]));
        assert!(f.len() < MAX_FIRST_FRAME / 8, "{}", f.len());
        a.write_all(&f).await.unwrap();
        let mut buf = BytesMut::new();
        let got = read_frame(&mut b, &mut buf, MAX_FIRST_FRAME).await.unwrap();
        assert_eq!(got.as_deref(), Some(&f[..]));
    }

    #[test]
    fn local_connections_beyond_the_cap_displace_the_oldest() {
        let inner = inner();
        let first = Awaiting::enter(&inner);
        let mut rest: Vec<_> = (1..MAX_AWAITING_CONNECT)
            .map(|_| Awaiting::enter(&inner))
            .collect();
        assert!(!first.displaced.is_cancelled());
        rest.push(Awaiting::enter(&inner));
        assert!(first.displaced.is_cancelled());
        assert!(rest.iter().all(|a| !a.displaced.is_cancelled()));
        assert_eq!(inner.awaiting.lock().len(), MAX_AWAITING_CONNECT);
        drop(first);
        drop(rest);
        assert!(inner.awaiting.lock().is_empty());
    }

    #[test]
    fn command_types_are_read_from_the_first_field() {
        let f = connect_frame(Some(MARKER), None);
        let (cmd, _) = split_frame(&f).unwrap();
        assert_eq!(command_type(cmd), Some(Type::Connect as i32));
        // A command whose type is not the first field is decoded.
        let c = proto::BaseCommand {
            r#type: Type::LookupResponse as i32,
            lookup_topic_response: Some(lookup(None, false)),
            ..Default::default()
        };
        let mut bytes = Vec::new();
        // field 4 (lookupTopicResponse) first, then field 1.
        prost::encoding::message::encode(4, c.lookup_topic_response.as_ref().unwrap(), &mut bytes);
        prost::encoding::int32::encode(1, &c.r#type, &mut bytes);
        assert_eq!(command_type(&bytes), Some(Type::LookupResponse as i32));
        assert_eq!(command_type(b"\xff\xff"), None);
    }

    #[test]
    fn frames_keep_their_payload_part() {
        let cmd = proto::BaseCommand {
            r#type: Type::Send as i32,
            ..Default::default()
        };
        let f = encode_frame(&cmd, b"\x0e\x01payload");
        let (c, rest) = split_frame(&f).unwrap();
        assert_eq!(rest, b"\x0e\x01payload");
        assert_eq!(command_type(c), Some(Type::Send as i32));
        assert_eq!(frame_size(&f, MAX_FRAME).unwrap(), f.len() - 4);
        assert!(frame_size(b"\xff\xff\xff\xff", MAX_FRAME).is_err());
    }

    /// The broker's AckResponse frame to consumer `consumer_id`'s request `request`.
    fn ack_response(consumer_id: u64, request: u64) -> Vec<u8> {
        frame_of(
            proto::BaseCommand {
                r#type: Type::AckResponse as i32,
                ack_response: Some(proto::CommandAckResponse {
                    consumer_id,
                    request_id: Some(request),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        )
    }

    fn frame_of(c: proto::BaseCommand, rest: &[u8]) -> Vec<u8> {
        encode_frame(&c, rest)
    }

    fn decode(frame: &[u8]) -> (proto::BaseCommand, Vec<u8>) {
        let (cmd, rest) = split_frame(frame).unwrap();
        (proto::BaseCommand::decode(cmd).unwrap(), rest.to_vec())
    }

    /// A SEND's payload part as the crate writes it: magic, CRC-32C, metadata, payload.
    fn payload_part(meta: &proto::MessageMetadata, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0x0e, 0x01, 0, 0, 0, 0];
        out.extend_from_slice(&(meta.encoded_len() as u32).to_be_bytes());
        meta.encode(&mut out).unwrap();
        out.extend_from_slice(payload);
        let crc = CRC32C.checksum(&out[6..]);
        out[2..6].copy_from_slice(&crc.to_be_bytes());
        out
    }

    /// A transaction's `SEND`s that pass after it ended (the wait for them timed out) carry
    /// it all the same, also once the producer is bound to its next transaction, whose own
    /// `SEND`s come after them; a batched `SEND` counts its messages.
    #[tokio::test]
    async fn sends_of_an_ended_transaction_keep_it() {
        let frames = TxnFrames::new(true);
        let conn = Mutex::new(ConnFrames::default());
        let (t1, t2) = (
            TxnId {
                most_bits: 1,
                least_bits: 1,
            },
            TxnId {
                most_bits: 1,
                least_bits: 2,
            },
        );
        let producer = frame_of(
            proto::BaseCommand {
                r#type: Type::Producer as i32,
                producer: Some(proto::CommandProducer {
                    topic: "persistent://public/default/t".into(),
                    producer_id: 3,
                    request_id: 1,
                    producer_name: Some("p".into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        );
        frames
            .rewrite(
                &conn,
                Direction::ToBroker,
                split_frame(&producer).unwrap().0,
                &[],
            )
            .unwrap();
        let send = |seq: u64, n: Option<i32>| {
            let meta = proto::MessageMetadata {
                producer_name: "p".into(),
                sequence_id: seq,
                publish_time: 1,
                ..Default::default()
            };
            frame_of(
                proto::BaseCommand {
                    r#type: Type::Send as i32,
                    send: Some(proto::CommandSend {
                        producer_id: 3,
                        sequence_id: seq,
                        num_messages: n,
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                &payload_part(&meta, b"x"),
            )
        };
        let txn_of = |f: &[u8]| {
            let (cmd, rest) = split_frame(f).unwrap();
            frames
                .rewrite(&conn, Direction::ToBroker, cmd, rest)
                .unwrap()
                .map(|out| {
                    let s = decode(&out).0.send.unwrap();
                    (s.txnid_most_bits.unwrap(), s.txnid_least_bits.unwrap())
                })
        };
        frames.bind_producer("p", t1, Duration::from_secs(60));
        for _ in 0..4 {
            frames.handed("p");
        }
        assert_eq!(txn_of(&send(0, None)), Some((1, 1)));
        assert!(
            !frames.sends_passed("p", Duration::from_millis(20)).await,
            "3 of 4 messages have not passed"
        );
        frames.end(t1, Duration::from_secs(60));
        frames.bind_producer("p", t2, Duration::from_secs(60));
        frames.handed("p");
        // Two of the three late ones in one batch, then the third, then the next one's own.
        assert_eq!(txn_of(&send(1, Some(2))), Some((1, 1)));
        assert_eq!(txn_of(&send(3, None)), Some((1, 1)));
        assert!(!frames.sends_passed("p", Duration::from_millis(20)).await);
        assert_eq!(txn_of(&send(4, None)), Some((1, 2)));
        assert!(frames.sends_passed("p", Duration::from_millis(20)).await);
        frames.end(t2, Duration::from_secs(60));
        assert_eq!(txn_of(&send(5, None)), None, "unbound, plain");

        // Late ones past their limit (the crate failed them by then) are not waited for.
        frames.bind_producer("p", t1, Duration::from_secs(60));
        frames.handed("p");
        frames.end(t1, Duration::ZERO);
        frames.bind_producer("p", t2, Duration::from_secs(60));
        assert_eq!(txn_of(&send(6, None)), Some((1, 2)));
    }

    #[test]
    fn transactions_go_on_sends_and_expected_acks_and_late_acks_are_dropped() {
        let frames = TxnFrames::new(true);
        let conn = Mutex::new(ConnFrames::default());
        let txn = TxnId {
            most_bits: 1,
            least_bits: 7,
        };
        let topic = "persistent://public/default/t";
        // The crate creates a named producer and subscribes a consumer.
        let producer = frame_of(
            proto::BaseCommand {
                r#type: Type::Producer as i32,
                producer: Some(proto::CommandProducer {
                    topic: topic.into(),
                    producer_id: 3,
                    request_id: 1,
                    producer_name: Some("p".into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &[],
        );
        let out = frames
            .rewrite(
                &conn,
                Direction::ToBroker,
                split_frame(&producer).unwrap().0,
                &[],
            )
            .unwrap()
            .unwrap();
        assert_eq!(decode(&out).0.producer.unwrap().txn_enabled, Some(true));
        let subscribe = proto::BaseCommand {
            r#type: Type::Subscribe as i32,
            subscribe: Some(proto::CommandSubscribe {
                topic: topic.into(),
                subscription: "g".into(),
                consumer_id: 5,
                ..Default::default()
            }),
            ..Default::default()
        };
        let f = frame_of(subscribe, &[]);
        assert!(frames
            .rewrite(&conn, Direction::ToBroker, split_frame(&f).unwrap().0, &[])
            .unwrap()
            .is_none());

        // A send of an unbound producer passes; bound, it carries the id in command and metadata.
        let meta = proto::MessageMetadata {
            producer_name: "p".into(),
            sequence_id: 0,
            publish_time: 1,
            ..Default::default()
        };
        let rest = payload_part(&meta, b"hello");
        let send = frame_of(
            proto::BaseCommand {
                r#type: Type::Send as i32,
                send: Some(proto::CommandSend {
                    producer_id: 3,
                    sequence_id: 0,
                    ..Default::default()
                }),
                ..Default::default()
            },
            &rest,
        );
        let (cmd, r) = split_frame(&send).unwrap();
        assert!(frames
            .rewrite(&conn, Direction::ToBroker, cmd, r)
            .unwrap()
            .is_none());
        frames.bind_producer("p", txn, Duration::from_secs(60));
        // The next message (a resend of the first would carry what the first carried).
        let send = frame_of(
            proto::BaseCommand {
                r#type: Type::Send as i32,
                send: Some(proto::CommandSend {
                    producer_id: 3,
                    sequence_id: 1,
                    ..Default::default()
                }),
                ..Default::default()
            },
            &rest,
        );
        let (cmd, r) = split_frame(&send).unwrap();
        let out = frames
            .rewrite(&conn, Direction::ToBroker, cmd, r)
            .unwrap()
            .unwrap();
        let (c, rest) = decode(&out);
        let s = c.send.unwrap();
        assert_eq!((s.txnid_most_bits, s.txnid_least_bits), (Some(1), Some(7)));
        let size = u32::from_be_bytes([rest[6], rest[7], rest[8], rest[9]]) as usize;
        let m = proto::MessageMetadata::decode(&rest[10..10 + size]).unwrap();
        assert_eq!((m.txnid_most_bits, m.txnid_least_bits), (Some(1), Some(7)));
        assert_eq!(&rest[10 + size..], b"hello");
        let crc = u32::from_be_bytes([rest[2], rest[3], rest[4], rest[5]]);
        assert_eq!(crc, CRC32C.checksum(&rest[6..]), "checksum made again");

        // Acks: an expected one carries the transaction and a request id of the bridge's.
        let id = |entry| proto::MessageIdData {
            ledger_id: 9,
            entry_id: entry,
            ..Default::default()
        };
        let ack = |entry| {
            frame_of(
                proto::BaseCommand {
                    r#type: Type::Ack as i32,
                    ack: Some(proto::CommandAck {
                        consumer_id: 5,
                        message_id: vec![id(entry)],
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                &[],
            )
        };
        frames.expect_acks(txn, topic, "g", &[id(0), id(1)]);
        let a0 = ack(0);
        let out = frames
            .rewrite(&conn, Direction::ToBroker, split_frame(&a0).unwrap().0, &[])
            .unwrap()
            .unwrap();
        let a = decode(&out).0.ack.unwrap();
        assert_eq!((a.txnid_most_bits, a.txnid_least_bits), (Some(1), Some(7)));
        let request = a.request_id.unwrap();
        assert!(request > TXN_ACK_REQUEST_IDS);
        // Another message's ack is plain.
        let a2 = ack(2);
        assert!(frames
            .rewrite(&conn, Direction::ToBroker, split_frame(&a2).unwrap().0, &[])
            .unwrap()
            .is_none());
        // The broker's answer is counted and never reaches the crate.
        let answer = ack_response(5, request);
        let out = frames
            .rewrite(
                &conn,
                Direction::ToClient,
                split_frame(&answer).unwrap().0,
                &[],
            )
            .unwrap()
            .unwrap();
        assert!(out.is_empty());
        // The transaction ends before message 1's ack passed: it is dropped when it does.
        frames.end(txn, Duration::from_secs(30));
        let a1 = ack(1);
        let out = frames
            .rewrite(&conn, Direction::ToBroker, split_frame(&a1).unwrap().0, &[])
            .unwrap()
            .unwrap();
        assert!(
            out.is_empty(),
            "an aborted transaction's ack never becomes a plain one"
        );
        // And the producer is unbound: its next message passes as it is, and a resend of the
        // one stamped above keeps the transaction.
        let send = frame_of(
            proto::BaseCommand {
                r#type: Type::Send as i32,
                send: Some(proto::CommandSend {
                    producer_id: 3,
                    sequence_id: 2,
                    ..Default::default()
                }),
                ..Default::default()
            },
            &rest,
        );
        let (cmd2, r2) = split_frame(&send).unwrap();
        assert!(frames
            .rewrite(&conn, Direction::ToBroker, cmd2, r2)
            .unwrap()
            .is_none());
        let out = frames
            .rewrite(&conn, Direction::ToBroker, cmd, r)
            .unwrap()
            .unwrap();
        let s = decode(&out).0.send.unwrap();
        assert_eq!((s.txnid_most_bits, s.txnid_least_bits), (Some(1), Some(7)));
    }

    #[tokio::test]
    async fn transactional_acks_go_out_at_once_on_the_one_subscribed_consumer() {
        let frames = TxnFrames::new(true);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let conn = Mutex::new(ConnFrames {
            id: 42,
            inject: Some(tx),
            ..ConnFrames::default()
        });
        let txn = TxnId {
            most_bits: 2,
            least_bits: 9,
        };
        let topic = "persistent://public/default/t-partition-0";
        let pass = |dir, f: &[u8]| {
            let (cmd, rest) = split_frame(f).unwrap();
            frames.rewrite(&conn, dir, cmd, rest).unwrap()
        };
        let subscribe = |consumer_id| {
            frame_of(
                proto::BaseCommand {
                    r#type: Type::Subscribe as i32,
                    subscribe: Some(proto::CommandSubscribe {
                        topic: topic.into(),
                        subscription: "g".into(),
                        consumer_id,
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                &[],
            )
        };
        assert!(pass(Direction::ToBroker, &subscribe(5)).is_none());
        let id = |entry, ack_set: Vec<i64>| proto::MessageIdData {
            ledger_id: 9,
            entry_id: entry,
            batch_index: Some(3),
            batch_size: Some(10),
            ack_set,
            ..Default::default()
        };
        let ack = |ids: Vec<proto::MessageIdData>| {
            frame_of(
                proto::BaseCommand {
                    r#type: Type::Ack as i32,
                    ack: Some(proto::CommandAck {
                        consumer_id: 5,
                        message_id: ids,
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                &[],
            )
        };

        // One ACK per message id (a refused command loses the broker every message id in
        // it), in the transaction, on the consumer's connection, each with its request id.
        frames.expect_acks(txn, topic, "g", &[id(0, vec![6]), id(1, vec![])]);
        let mut requests = Vec::new();
        for want in [id(0, vec![6]), id(1, vec![])] {
            let sent = rx.try_recv().expect("an ACK written by the bridge");
            let a = decode(&sent).0.ack.unwrap();
            assert_eq!(a.consumer_id, 5);
            assert_eq!((a.txnid_most_bits, a.txnid_least_bits), (Some(2), Some(9)));
            assert_eq!(a.message_id, vec![want]);
            let request = a.request_id.unwrap();
            assert!(request > TXN_ACK_REQUEST_IDS);
            assert!(!requests.contains(&request));
            requests.push(request);
        }
        assert!(rx.try_recv().is_err(), "two ACKs");

        // The crate's own ACKs of them are dropped as they pass; any other passes as it is,
        // also one of the same message id with another ack set.
        let other = ack(vec![id(0, vec![1])]);
        assert!(pass(Direction::ToBroker, &other).is_none());
        assert!(pass(Direction::ToBroker, &ack(vec![id(0, vec![6])]))
            .unwrap()
            .is_empty());
        assert!(pass(Direction::ToBroker, &ack(vec![id(1, vec![])]))
            .unwrap()
            .is_empty());
        assert!(
            pass(Direction::ToBroker, &ack(vec![id(1, vec![])])).is_none(),
            "only as many copies as were sent are dropped"
        );

        // The answers count for the transaction: both are awaited.
        let answer = ack_response(5, requests[0]);
        assert!(pass(Direction::ToClient, &answer).unwrap().is_empty());
        assert!(frames
            .acks_answered(txn, 2, Duration::from_millis(50))
            .await
            .is_err());
        let answer = ack_response(5, requests[1]);
        assert!(pass(Direction::ToClient, &answer).unwrap().is_empty());
        frames
            .acks_answered(txn, 2, Duration::from_secs(1))
            .await
            .unwrap();

        // Two consumers of the subscription: which holds the messages is not known, so the
        // crate's ACK carries the transaction as before.
        assert!(pass(Direction::ToBroker, &subscribe(6)).is_none());
        frames.expect_acks(txn, topic, "g", &[id(2, vec![])]);
        assert!(rx.try_recv().is_err());
        let out = pass(Direction::ToBroker, &ack(vec![id(2, vec![])])).unwrap();
        assert_eq!(decode(&out).0.ack.unwrap().txnid_least_bits, Some(9));

        // Once one closes, the other is the one again.
        let close = frame_of(
            proto::BaseCommand {
                r#type: Type::CloseConsumer as i32,
                close_consumer: Some(proto::CommandCloseConsumer {
                    consumer_id: 6,
                    request_id: 1,
                }),
                ..Default::default()
            },
            &[],
        );
        assert!(pass(Direction::ToBroker, &close).is_none());
        frames.expect_acks(txn, topic, "g", &[id(3, vec![])]);
        assert_eq!(
            decode(&rx.try_recv().unwrap()).0.ack.unwrap().consumer_id,
            5
        );

        // A connection gone: the crate's ACK carries the transaction.
        drop(rx);
        frames.expect_acks(txn, topic, "g", &[id(4, vec![])]);
        let out = pass(Direction::ToBroker, &ack(vec![id(4, vec![])])).unwrap();
        assert_eq!(decode(&out).0.ack.unwrap().txnid_least_bits, Some(9));
    }
}
