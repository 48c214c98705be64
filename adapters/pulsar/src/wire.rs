//! onceflow's own connections to Pulsar brokers, for the commands the pulsar crate does not
//! send: the transaction coordinator protocol (PIP-31; see `txn.rs`).
//!
//! A [`Wire`] is one broker connection (TCP, TLS with the connection's trusted CAs and, with
//! `tls_cert_file`, the client certificate), opened with the `CONNECT` command carrying the
//! connection's credential (token, token file, OAuth2 access token; `tls` with a client
//! certificate), framed by the pulsar crate's own codec (`pulsar::message::Codec`) over its
//! generated protobuf types (`pulsar::proto`). Requests carry a `request_id`; a reader task
//! hands each answer to its request, answers `PING` and `AUTH_CHALLENGE` (with the credential
//! read again, so a rotated token file or a refreshed OAuth2 token is presented), and fails
//! every open request with a retriable `Connect` error when the connection ends.
//!
//! Pulsar's binary protocol: <https://pulsar.apache.org/docs/next/developing-binary-protocol/>.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use onceflow_core::{Error, ErrorKind, Result};
use parking_lot::Mutex;
use pulsar::message::{Codec, Message};
use pulsar::proto::{self, base_command::Type, BaseCommand};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;

use crate::bridge::Present;

/// The byte stream under a [`Wire`]: TCP or TLS over TCP.
pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// How [`Wire`]s connect: TLS, credential and timeouts of one `pulsar://` connection.
#[derive(Clone)]
pub(crate) struct WireConfig {
    /// TLS towards the brokers (`pulsar+ssl://`), with the client certificate if any.
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
    /// What `CONNECT` presents.
    pub(crate) present: Present,
    /// Connecting, the handshake and each request, at most.
    pub(crate) timeout: Duration,
}

impl std::fmt::Debug for WireConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireConfig")
            .field("tls", &self.tls.is_some())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// A broker address: `host`, `port`, and whether it is a TLS listener.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct BrokerAddr {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) tls: bool,
}

impl std::fmt::Display for BrokerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls { "pulsar+ssl" } else { "pulsar" };
        if self.host.contains(':') {
            write!(f, "{scheme}://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}://{}:{}", self.host, self.port)
        }
    }
}

impl BrokerAddr {
    /// The first broker of a `pulsar://` / `pulsar+ssl://` URL (6650 / 6651 by default).
    pub(crate) fn of_url(url: &str) -> Option<BrokerAddr> {
        let tls = url.starts_with("pulsar+ssl://");
        let first = *crate::service_hosts(url).first()?;
        let (host, port) = match first.strip_prefix('[') {
            Some(v6) => {
                let (h, rest) = v6.split_once(']')?;
                (h, rest.strip_prefix(':'))
            }
            None => match first.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (first, None),
            },
        };
        if host.is_empty() {
            return None;
        }
        let port = match port {
            Some(p) => p.parse().ok()?,
            None if tls => 6651,
            None => 6650,
        };
        Some(BrokerAddr {
            host: host.to_string(),
            port,
            tls,
        })
    }
}

/// Answers awaited, by request id.
type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<BaseCommand>>>>;

/// One connection of onceflow's own to a broker (see the module docs). Dropping it closes the
/// connection.
pub(crate) struct Wire {
    addr: BrokerAddr,
    out: mpsc::UnboundedSender<Message>,
    pending: Pending,
    next_request: AtomicU64,
    closed: Arc<AtomicBool>,
    stop: CancellationToken,
    timeout: Duration,
}

impl std::fmt::Debug for Wire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wire")
            .field("addr", &self.addr.to_string())
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A command of `ty` with nothing set yet.
pub(crate) fn command(ty: Type) -> BaseCommand {
    BaseCommand {
        r#type: ty as i32,
        ..Default::default()
    }
}

/// The request id an answer (or request) carries, for the commands a [`Wire`] sends.
fn request_id(c: &BaseCommand) -> Option<u64> {
    c.success
        .as_ref()
        .map(|x| x.request_id)
        .or_else(|| c.error.as_ref().map(|x| x.request_id))
        .or_else(|| c.lookup_topic_response.as_ref().map(|x| x.request_id))
        .or_else(|| c.partition_metadata_response.as_ref().map(|x| x.request_id))
        .or_else(|| c.tc_client_connect_response.as_ref().map(|x| x.request_id))
        .or_else(|| c.new_txn_response.as_ref().map(|x| x.request_id))
        .or_else(|| {
            c.add_partition_to_txn_response
                .as_ref()
                .map(|x| x.request_id)
        })
        .or_else(|| {
            c.add_subscription_to_txn_response
                .as_ref()
                .map(|x| x.request_id)
        })
        .or_else(|| c.end_txn_response.as_ref().map(|x| x.request_id))
}

impl Wire {
    /// Connects to `addr` and completes the `CONNECT` handshake (through a Pulsar proxy with
    /// `proxy_to_broker_url`). `Connect` / `Timeout` when the broker cannot be reached or
    /// does not answer within `config.timeout`, `Auth` when it refuses the credential or
    /// certificate.
    pub(crate) async fn connect(
        config: &WireConfig,
        addr: &BrokerAddr,
        proxy_to_broker_url: Option<String>,
    ) -> Result<Wire> {
        let server = addr.to_string();
        let stream = tokio::time::timeout(config.timeout, open(config, addr))
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "no connection to the Pulsar broker at {server} within {} ms",
                        config.timeout.as_millis()
                    ),
                )
            })??;
        let mut framed = Framed::new(stream, Codec);
        let (method, data) = connect_credential(config, &server).await?;
        let mut connect = command(Type::Connect);
        connect.connect = Some(proto::CommandConnect {
            client_version: format!("onceflow-{}", env!("CARGO_PKG_VERSION")),
            protocol_version: Some(21),
            auth_method_name: method,
            auth_data: data,
            proxy_to_broker_url,
            feature_flags: Some(proto::FeatureFlags {
                supports_auth_refresh: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        });
        let handshake = async {
            framed
                .send(Message {
                    command: connect,
                    payload: None,
                })
                .await
                .map_err(|e| lost(&server, &e.to_string()))?;
            loop {
                let answer = framed
                    .next()
                    .await
                    .ok_or_else(|| lost(&server, "closed during CONNECT"))?
                    .map_err(|e| lost(&server, &e.to_string()))?;
                if answer.command.connected.is_some() {
                    return Ok(());
                }
                if let Some(e) = answer.command.error {
                    return Err(server_error(&server, "CONNECT", e.error, &e.message));
                }
                if answer.command.auth_challenge.is_some() {
                    let reply = auth_response(config, &server).await?;
                    framed
                        .send(reply)
                        .await
                        .map_err(|e| lost(&server, &e.to_string()))?;
                }
            }
        };
        tokio::time::timeout(config.timeout, handshake)
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the Pulsar broker at {server} did not complete the CONNECT handshake \
                         within {} ms",
                        config.timeout.as_millis()
                    ),
                )
            })??;
        let (mut sink, mut stream) = framed.split();
        let (out, mut rx) = mpsc::unbounded_channel::<Message>();
        let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
        let closed = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        {
            let stop = stop.clone();
            let server = server.clone();
            tokio::spawn(async move {
                loop {
                    let m = tokio::select! {
                        _ = stop.cancelled() => break,
                        m = rx.recv() => m,
                    };
                    let Some(m) = m else { break };
                    if let Err(e) = sink.send(m).await {
                        tracing::debug!(broker = %server, error = %e, "Pulsar connection: write failed");
                        break;
                    }
                }
                let _ = sink.close().await;
                stop.cancel();
            });
        }
        {
            let stop = stop.clone();
            let out = out.clone();
            let pending = pending.clone();
            let closed = closed.clone();
            let config = config.clone();
            tokio::spawn(async move {
                loop {
                    let m = tokio::select! {
                        _ = stop.cancelled() => break,
                        m = stream.next() => m,
                    };
                    let m = match m {
                        Some(Ok(m)) => m,
                        Some(Err(e)) => {
                            tracing::debug!(broker = %server, error = %e, "Pulsar connection: read failed");
                            break;
                        }
                        None => break,
                    };
                    let c = m.command;
                    if c.ping.is_some() {
                        let _ = out.send(Message {
                            command: BaseCommand {
                                pong: Some(proto::CommandPong {}),
                                ..command(Type::Pong)
                            },
                            payload: None,
                        });
                    } else if c.auth_challenge.is_some() {
                        match auth_response(&config, &server).await {
                            Ok(reply) => {
                                let _ = out.send(reply);
                            }
                            Err(e) => {
                                tracing::warn!(broker = %server, error = %e, "Pulsar connection: no credential for the broker's AUTH_CHALLENGE");
                            }
                        }
                    } else if let Some(id) = request_id(&c) {
                        if let Some(tx) = pending.lock().remove(&id) {
                            let _ = tx.send(c);
                        }
                    } else if c.close_producer.is_none() && c.close_consumer.is_none() {
                        tracing::trace!(broker = %server, r#type = c.r#type, "Pulsar connection: unexpected command");
                    }
                }
                closed.store(true, Ordering::Release);
                stop.cancel();
                // Open requests end with the connection (their senders are dropped).
                pending.lock().clear();
            });
        }
        Ok(Wire {
            addr: addr.clone(),
            out,
            pending,
            next_request: AtomicU64::new(1),
            closed,
            stop,
            timeout: config.timeout,
        })
    }

    /// The broker this connection goes to.
    pub(crate) fn addr(&self) -> &BrokerAddr {
        &self.addr
    }

    /// The connection ended (the broker closed it, or a read or write failed).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.stop.is_cancelled()
    }

    /// A request id of this connection.
    pub(crate) fn next_request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends `cmd`, which carries `request_id`, and waits for its answer, at most the
    /// connection's timeout. `Connect` (retriable) when the connection ends first; `Timeout`
    /// (retriable, outcome unknown) when no answer came in time.
    pub(crate) async fn request(&self, request_id: u64, cmd: BaseCommand) -> Result<BaseCommand> {
        let server = self.addr.to_string();
        let (tx, rx) = oneshot::channel();
        self.pending.lock().insert(request_id, tx);
        if self.is_closed()
            || self
                .out
                .send(Message {
                    command: cmd,
                    payload: None,
                })
                .is_err()
        {
            self.pending.lock().remove(&request_id);
            return Err(lost(&server, "the connection is closed"));
        }
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(_)) => Err(lost(&server, "the connection closed before the answer")),
            Err(_) => {
                self.pending.lock().remove(&request_id);
                Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "no answer from the Pulsar broker at {server} within {} ms",
                        self.timeout.as_millis()
                    ),
                )
                .retriable(true)
                .with_outcome_unknown())
            }
        }
    }
}

/// TCP, then TLS for a TLS listener.
async fn open(config: &WireConfig, addr: &BrokerAddr) -> Result<Box<dyn Io>> {
    let server = addr.to_string();
    let tcp = tokio::net::TcpStream::connect((addr.host.as_str(), addr.port))
        .await
        .map_err(|e| {
            Error::new(
                ErrorKind::Connect,
                format!("cannot reach the Pulsar broker at {server}: {e}"),
            )
            .retriable(true)
        })?;
    let _ = tcp.set_nodelay(true);
    if !addr.tls {
        return Ok(Box::new(tcp));
    }
    let tls = config.tls.clone().ok_or_else(|| {
        Error::config(format!(
            "the Pulsar broker at {server} is a TLS listener, but the connection was made \
             without TLS (use a pulsar+ssl:// URL)"
        ))
    })?;
    let name = rustls::pki_types::ServerName::try_from(addr.host.clone()).map_err(|e| {
        Error::config(format!(
            "Pulsar at {server}: '{}' is not a host name for TLS: {e}",
            addr.host
        ))
    })?;
    match tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
    {
        Ok(s) => Ok(Box::new(s)),
        Err(e) => {
            let e = crate::bridge::refused_after_handshake(&config.present, &server, &e);
            let retriable = e.kind() == ErrorKind::Connect;
            Err(e.retriable(retriable))
        }
    }
}

/// The auth method and data `CONNECT` carries.
async fn connect_credential(
    config: &WireConfig,
    server: &str,
) -> Result<(Option<String>, Option<Vec<u8>>)> {
    config.present.auth().await.map_err(|e| {
        Error::new(
            ErrorKind::Auth,
            format!("Pulsar at {server}: no credential to present: {e}"),
        )
    })
}

/// `AUTH_RESPONSE` to a broker's `AUTH_CHALLENGE`, with the credential read again.
async fn auth_response(config: &WireConfig, server: &str) -> Result<Message> {
    let (method, data) = connect_credential(config, server).await?;
    Ok(Message {
        command: BaseCommand {
            auth_response: Some(proto::CommandAuthResponse {
                client_version: Some(format!("onceflow-{}", env!("CARGO_PKG_VERSION"))),
                protocol_version: Some(21),
                response: Some(proto::AuthData {
                    auth_method_name: method,
                    auth_data: Some(data.unwrap_or_default()),
                }),
            }),
            ..command(Type::AuthResponse)
        },
        payload: None,
    })
}

/// The connection to `server` ended: a retriable `Connect` error.
fn lost(server: &str, why: &str) -> Error {
    Error::new(
        ErrorKind::Connect,
        format!("the connection to the Pulsar broker at {server} was lost: {why}"),
    )
    .retriable(true)
}

/// A broker's `ServerError` answer to `what` as onceflow's error kind.
pub(crate) fn server_error(server: &str, what: &str, code: i32, message: &str) -> Error {
    use proto::ServerError as E;
    let name = E::try_from(code).map_or_else(|_| format!("error {code}"), |e| format!("{e:?}"));
    let text = format!("Pulsar at {server} refused {what}: {name}: {message}");
    match E::try_from(code) {
        Ok(E::AuthenticationError | E::AuthorizationError) => Error::new(ErrorKind::Auth, text),
        Ok(E::TopicNotFound | E::SubscriptionNotFound | E::TransactionNotFound) => {
            Error::new(ErrorKind::NotFound, text)
        }
        Ok(E::ServiceNotReady | E::TooManyRequests | E::TransactionCoordinatorNotFound) => {
            Error::new(ErrorKind::Connect, text).retriable(true)
        }
        Ok(E::NotAllowedError) => Error::new(ErrorKind::Unsupported, text),
        Ok(E::TransactionConflict | E::InvalidTxnStatus) => Error::new(ErrorKind::Aborted, text),
        Ok(E::ProducerFenced) => Error::new(ErrorKind::Fenced, text),
        _ => Error::new(ErrorKind::Platform, text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_addresses_of_urls() {
        let a = BrokerAddr::of_url("pulsar://127.0.0.1:16650?admin=http://x").unwrap();
        assert_eq!(
            (a.host.as_str(), a.port, a.tls),
            ("127.0.0.1", 16650, false)
        );
        let a = BrokerAddr::of_url("pulsar+ssl://broker.example").unwrap();
        assert_eq!(
            (a.host.as_str(), a.port, a.tls),
            ("broker.example", 6651, true)
        );
        let a = BrokerAddr::of_url("pulsar://[::1]:6650,other:6650/").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("::1", 6650));
        assert_eq!(a.to_string(), "pulsar://[::1]:6650");
        assert!(BrokerAddr::of_url("http://x:1").is_none());
        assert!(BrokerAddr::of_url("pulsar://:1").is_none());
    }

    #[test]
    fn answers_are_matched_by_request_id() {
        let mut c = command(Type::NewTxnResponse);
        c.new_txn_response = Some(proto::CommandNewTxnResponse {
            request_id: 7,
            ..Default::default()
        });
        assert_eq!(request_id(&c), Some(7));
        let mut c = command(Type::Error);
        c.error = Some(proto::CommandError {
            request_id: 9,
            ..Default::default()
        });
        assert_eq!(request_id(&c), Some(9));
        assert_eq!(request_id(&command(Type::Ping)), None);
    }

    #[test]
    fn server_errors_map_to_kinds() {
        let e = server_error(
            "pulsar://b:1",
            "END_TXN",
            proto::ServerError::InvalidTxnStatus as i32,
            "expired",
        );
        assert_eq!(e.kind(), ErrorKind::Aborted);
        assert!(e.message().contains("InvalidTxnStatus"), "{e}");
        let e = server_error(
            "pulsar://b:1",
            "NEW_TXN",
            proto::ServerError::TransactionCoordinatorNotFound as i32,
            "",
        );
        assert_eq!(e.kind(), ErrorKind::Connect);
        assert!(e.is_retriable());
    }
}
