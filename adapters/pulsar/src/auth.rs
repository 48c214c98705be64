//! Credentials and TLS of a connection: the token-file provider, the provider shared by the
//! broker connection and the admin REST client, the trusted CAs, and the diagnosis of a
//! refused connection (which certificate or which credential the server refused).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::{SinkExt, StreamExt};
use onceflow_core::{Error, ErrorKind, Result};
use pulsar::authentication::Authentication;
use pulsar::error::AuthenticationError;
use pulsar::message::proto;

use crate::config::{PulsarAuth, PulsarOptions};

/// A token read from a file, read again when the file's modification time or length changed
/// (a rotated token is used from the next connection, auth challenge or admin call on).
pub(crate) struct TokenFile {
    path: PathBuf,
    /// (modification time, length, token) of the last read.
    cached: Option<(Option<SystemTime>, u64, Vec<u8>)>,
}

impl TokenFile {
    pub(crate) fn new(path: PathBuf) -> TokenFile {
        TokenFile { path, cached: None }
    }

    /// The token, re-read if the file changed. The error names the file, never its content.
    pub(crate) fn token(&mut self) -> std::result::Result<Vec<u8>, String> {
        let meta = std::fs::metadata(&self.path)
            .map_err(|e| format!("cannot read the token file {}: {e}", self.path.display()))?;
        let stamp = (meta.modified().ok(), meta.len());
        if let Some((m, l, t)) = &self.cached {
            if (*m, *l) == stamp {
                return Ok(t.clone());
            }
        }
        let raw = std::fs::read(&self.path)
            .map_err(|e| format!("cannot read the token file {}: {e}", self.path.display()))?;
        let token = String::from_utf8(raw)
            .map_err(|_| format!("the token file {} is not UTF-8", self.path.display()))?
            .trim()
            .as_bytes()
            .to_vec();
        if token.is_empty() {
            return Err(format!("the token file {} is empty", self.path.display()));
        }
        tracing::debug!(file = %self.path.display(), "read the Pulsar token file");
        self.cached = Some((stamp.0, stamp.1, token.clone()));
        Ok(token)
    }
}

#[async_trait]
impl Authentication for TokenFile {
    fn auth_method_name(&self) -> String {
        "token".to_string()
    }

    async fn initialize(&mut self) -> std::result::Result<(), AuthenticationError> {
        self.token()
            .map(|_| ())
            .map_err(AuthenticationError::Custom)
    }

    async fn auth_data(&mut self) -> std::result::Result<Vec<u8>, AuthenticationError> {
        self.token().map_err(AuthenticationError::Custom)
    }
}

struct Provider {
    inner: Box<dyn Authentication>,
    initialized: bool,
}

/// One authentication provider used by both the pulsar crate's connections and the admin
/// REST client (so an OAuth2 access token is fetched once for both, a token file read once
/// per change).
#[derive(Clone)]
pub(crate) struct SharedAuth {
    provider: Arc<tokio::sync::Mutex<Provider>>,
    method: String,
}

impl SharedAuth {
    fn new(inner: Box<dyn Authentication>) -> SharedAuth {
        SharedAuth {
            method: inner.auth_method_name(),
            provider: Arc::new(tokio::sync::Mutex::new(Provider {
                inner,
                initialized: false,
            })),
        }
    }

    /// The current credential (initializing the provider on first use).
    pub(crate) async fn data(&self) -> std::result::Result<Vec<u8>, AuthenticationError> {
        let mut p = self.provider.lock().await;
        if !p.initialized {
            p.inner.initialize().await?;
            p.initialized = true;
        }
        p.inner.auth_data().await
    }
}

#[async_trait]
impl Authentication for SharedAuth {
    fn auth_method_name(&self) -> String {
        self.method.clone()
    }

    async fn initialize(&mut self) -> std::result::Result<(), AuthenticationError> {
        let mut p = self.provider.lock().await;
        if !p.initialized {
            p.inner.initialize().await?;
            p.initialized = true;
        }
        Ok(())
    }

    async fn auth_data(&mut self) -> std::result::Result<Vec<u8>, AuthenticationError> {
        self.data().await
    }
}

/// What a connection presents: nothing, a fixed token, a provider, or a TLS client
/// certificate (presented by the TLS layer: the mTLS bridge and the admin client's TLS).
#[derive(Clone)]
pub(crate) enum Credentials {
    None,
    Token(String),
    Provider(SharedAuth),
    ClientCert,
}

impl Credentials {
    /// The credentials of `options`; a token file or OAuth2 key file that cannot be read is a
    /// `Config` error here, before anything is contacted.
    pub(crate) fn of(options: &PulsarOptions) -> Result<Credentials> {
        Ok(match &options.auth {
            PulsarAuth::None => Credentials::None,
            PulsarAuth::Token(t) => Credentials::Token(t.clone()),
            PulsarAuth::TokenFile(path) => {
                let mut f = TokenFile::new(path.clone());
                f.token().map_err(Error::config)?;
                Credentials::Provider(SharedAuth::new(Box::new(f)))
            }
            PulsarAuth::OAuth2(o) => oauth2(o)?,
            PulsarAuth::Tls(_) => Credentials::ClientCert,
        })
    }

    /// The auth method the admin REST calls name (`X-Pulsar-Auth-Method-Name`), if any.
    pub(crate) fn http_method(&self) -> Option<&'static str> {
        match self {
            Credentials::None => None,
            Credentials::Token(_) | Credentials::Provider(_) => Some("token"),
            Credentials::ClientCert => Some("tls"),
        }
    }

    /// What the credential is, for messages: `token`, `token file PATH`, `OAuth2 token`.
    pub(crate) fn describe(options: &PulsarOptions) -> String {
        match &options.auth {
            PulsarAuth::None => "no credentials (anonymous)".to_string(),
            PulsarAuth::Token(_) => "the token".to_string(),
            PulsarAuth::TokenFile(p) => format!("the token of {}", p.display()),
            PulsarAuth::OAuth2(o) => format!("the OAuth2 access token from {}", o.issuer_url),
            PulsarAuth::Tls(c) => format!("the client certificate {}", c.cert_file.display()),
        }
    }

    /// The bearer token of an admin REST call, if any. `Auth` when the provider cannot give
    /// one (the OAuth2 token endpoint refused the client, the token file went away).
    pub(crate) async fn bearer(&self) -> Result<Option<String>> {
        match self {
            Credentials::None | Credentials::ClientCert => Ok(None),
            Credentials::Token(t) => Ok(Some(t.clone())),
            Credentials::Provider(p) => {
                let data = p.data().await.map_err(|e| {
                    Error::new(
                        ErrorKind::Auth,
                        format!("no credentials for the Pulsar admin API: {e}"),
                    )
                })?;
                String::from_utf8(data).map(Some).map_err(|_| {
                    Error::new(ErrorKind::Auth, "the Pulsar credential is not UTF-8 text")
                })
            }
        }
    }

    /// The credential as the crate's CONNECT carries it, for the diagnosis.
    pub(crate) async fn connect_data(
        &self,
    ) -> std::result::Result<Option<(String, Vec<u8>)>, String> {
        match self {
            Credentials::None | Credentials::ClientCert => Ok(None),
            Credentials::Token(t) => Ok(Some(("token".to_string(), t.clone().into_bytes()))),
            Credentials::Provider(p) => p
                .data()
                .await
                .map(|d| Some((p.method.clone(), d)))
                .map_err(|e| e.to_string()),
        }
    }
}

fn oauth2(o: &crate::config::OAuth2Options) -> Result<Credentials> {
    // The key file is read by the crate at initialize; read it here first so a missing or
    // malformed file is a Config error naming it (its content, the secret, is not shown).
    let text = std::fs::read_to_string(&o.credentials_file).map_err(|e| {
        Error::config(format!(
            "cannot read the OAuth2 credentials file {}: {e}",
            o.credentials_file.display()
        ))
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|_| {
        Error::config(format!(
            "the OAuth2 credentials file {} is not JSON with client_id and client_secret",
            o.credentials_file.display()
        ))
    })?;
    if v.get("client_id").and_then(|x| x.as_str()).is_none()
        || v.get("client_secret").and_then(|x| x.as_str()).is_none()
    {
        return Err(Error::config(format!(
            "the OAuth2 credentials file {} has no client_id or client_secret",
            o.credentials_file.display()
        )));
    }
    let path = std::path::absolute(&o.credentials_file).map_err(|e| {
        Error::config(format!(
            "OAuth2 credentials file {}: {e}",
            o.credentials_file.display()
        ))
    })?;
    let credentials_url = url::Url::from_file_path(&path)
        .map_err(|_| {
            Error::config(format!(
                "OAuth2 credentials file {}: not a file path",
                path.display()
            ))
        })?
        .to_string();
    let provider = pulsar::authentication::oauth2::OAuth2Authentication::client_credentials(
        pulsar::authentication::oauth2::OAuth2Params {
            issuer_url: o.issuer_url.clone(),
            credentials_url,
            audience: o.audience.clone(),
            scope: o.scope.clone(),
        },
    );
    Ok(Credentials::Provider(SharedAuth::new(provider)))
}

/// Installs ring as rustls's process-wide crypto provider when none is: the pulsar crate
/// builds its TLS configuration with the process default, which rustls cannot pick by itself
/// when a build links more than one provider (aws-lc-rs comes with the AWS SDK).
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// The PEM bytes of `tls_trust_certs`, checked to hold at least one certificate. `Config`
/// error naming the file otherwise.
pub(crate) fn trusted_pem(path: &Path) -> Result<Vec<u8>> {
    use rustls::pki_types::pem::PemObject;
    let pem = std::fs::read(path).map_err(|e| {
        Error::config(format!(
            "cannot read tls_trust_certs={}: {e}",
            path.display()
        ))
    })?;
    let n = rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| {
            Error::config(format!(
                "tls_trust_certs={}: not PEM certificates ({e})",
                path.display()
            ))
        })?
        .len();
    if n == 0 {
        return Err(Error::config(format!(
            "tls_trust_certs={}: no certificate in it (expected PEM, -----BEGIN CERTIFICATE-----)",
            path.display()
        )));
    }
    Ok(pem)
}

/// The rustls client configuration the pulsar crate builds for `pulsar+ssl://` (webpki roots
/// plus the trusted CAs, no client certificate), for the diagnosis.
pub(crate) fn tls_config(pem: Option<&[u8]>) -> Result<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(pem) = pem {
        for c in rustls::pki_types::CertificateDer::pem_slice_iter(pem) {
            let c = c.map_err(|e| Error::config(format!("tls_trust_certs: {e}")))?;
            roots
                .add(c)
                .map_err(|e| Error::config(format!("tls_trust_certs: {e}")))?;
        }
    }
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::config(format!("TLS: {e}")))?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

/// The rustls error inside an error chain, if any (also inside nested `io::Error`s, whose
/// `source` skips the error they wrap).
pub(crate) fn rustls_error<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(x) = cur {
        if let Some(r) = x.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        cur = match x.downcast_ref::<std::io::Error>() {
            Some(io) => match io.get_ref() {
                Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
                None => x.source(),
            },
            None => x.source(),
        };
    }
    None
}

/// A refused certificate as an `Auth` error naming the server.
pub(crate) fn certificate_error(what: &str, server: &str, e: &rustls::Error) -> Error {
    let why = match e {
        rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer) => {
            " (its issuer is not trusted: give the CA with tls_trust_certs=/path/ca.pem)"
                .to_string()
        }
        rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName)
        | rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForNameContext {
            ..
        }) => " (the certificate does not name this host: connect with a name it has)".to_string(),
        _ => String::new(),
    };
    Error::new(
        ErrorKind::Auth,
        format!("{what} at {server}: the server's TLS certificate was refused: {e}{why}"),
    )
}

/// How long the diagnosis of a refused connection may take.
const DIAGNOSIS_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the broker at `options.service_url` refused the pulsar crate's connection: connects
/// once more on its own (TCP, the TLS handshake with the same trusted CAs and host name, then
/// the CONNECT command with the same credential, through the crate's own frame codec) and
/// returns the error of the step that failed: `Auth` for a refused certificate or
/// credential (the broker's AuthenticationError), `Connect` for the rest. `None` when this
/// connection succeeds (the crate failed for another reason).
pub(crate) async fn diagnose(
    options: &PulsarOptions,
    credentials: &Credentials,
    trusted: Option<&[u8]>,
) -> Option<Error> {
    tokio::time::timeout(
        DIAGNOSIS_TIMEOUT,
        diagnose_inner(options, credentials, trusted),
    )
    .await
    .unwrap_or_default()
}

async fn diagnose_inner(
    options: &PulsarOptions,
    credentials: &Credentials,
    trusted: Option<&[u8]>,
) -> Option<Error> {
    let server = onceflow_core::redact_credentials(&options.service_url);
    let url = url::Url::parse(&options.service_url).ok()?;
    let tls = url.scheme() == "pulsar+ssl";
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = url.port().unwrap_or(if tls { 6651 } else { 6650 });
    let tcp = tokio::net::TcpStream::connect((host, port)).await.ok()?;
    let data = match credentials.connect_data().await {
        Ok(d) => d,
        Err(e) => {
            return Some(Error::new(
                ErrorKind::Auth,
                format!(
                    "Pulsar at {server}: no credential to present ({}): {e}",
                    Credentials::describe(options)
                ),
            ))
        }
    };
    if tls {
        let config = match tls_config(trusted) {
            Ok(c) => c,
            Err(e) => return Some(e),
        };
        let name = match rustls::pki_types::ServerName::try_from(host.to_string()) {
            Ok(n) => n,
            Err(e) => {
                return Some(Error::config(format!(
                    "Pulsar at {server}: '{host}' is not a host name for TLS: {e}"
                )))
            }
        };
        let stream = match tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
        {
            Ok(s) => s,
            Err(e) => {
                return Some(match rustls_error(&e) {
                    Some(
                        r @ (rustls::Error::InvalidCertificate(_)
                        | rustls::Error::NoCertificatesPresented),
                    ) => certificate_error("Pulsar", &server, r),
                    _ => Error::new(
                        ErrorKind::Connect,
                        format!(
                            "Pulsar at {server}: the TLS handshake failed: {e} (is it the \
                             broker's TLS port, brokerServicePortTls, 6651 by default?)"
                        ),
                    ),
                })
            }
        };
        connect_command(options, &server, stream, data).await
    } else {
        connect_command(options, &server, tcp, data).await
    }
}

/// Sends the CONNECT command with `data` and reads the broker's answer.
async fn connect_command<S>(
    options: &PulsarOptions,
    server: &str,
    stream: S,
    data: Option<(String, Vec<u8>)>,
) -> Option<Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut framed = tokio_util::codec::Framed::new(stream, pulsar::message::Codec);
    let (auth_method_name, auth_data) = match data {
        Some((m, d)) => (Some(m), Some(d)),
        None => (None, None),
    };
    let connect = pulsar::message::Message {
        command: proto::BaseCommand {
            r#type: proto::base_command::Type::Connect as i32,
            connect: Some(proto::CommandConnect {
                auth_method_name,
                auth_data,
                client_version: proto::client_version(),
                protocol_version: Some(12),
                ..Default::default()
            }),
            ..Default::default()
        },
        payload: None,
    };
    framed.send(connect).await.ok()?;
    let answer = framed.next().await?.ok()?;
    let error = answer.command.error?;
    let refused = error.error == proto::ServerError::AuthenticationError as i32
        || error.error == proto::ServerError::AuthorizationError as i32;
    let message = scrub(&error.message, options);
    Some(if refused {
        Error::new(
            ErrorKind::Auth,
            format!(
                "Pulsar at {server} refused {}: {message}",
                Credentials::describe(options)
            ),
        )
    } else {
        Error::new(
            ErrorKind::Connect,
            format!("Pulsar at {server} refused the connection: {message}"),
        )
    })
}

/// `text` without the connection's token, should a server ever quote it.
pub(crate) fn scrub(text: &str, options: &PulsarOptions) -> String {
    match &options.auth {
        PulsarAuth::Token(t) if !t.is_empty() => text.replace(t.as_str(), "***"),
        _ => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_file_is_read_again_when_it_changes() {
        let dir = std::env::temp_dir().join(format!("onceflow-tf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "first\n").unwrap();
        let mut f = TokenFile::new(path.clone());
        assert_eq!(f.token().unwrap(), b"first");
        std::fs::write(&path, "second-and-longer").unwrap();
        assert_eq!(f.token().unwrap(), b"second-and-longer");
        std::fs::write(&path, "").unwrap();
        let e = f.token().unwrap_err();
        assert!(e.contains("is empty"), "{e}");
        std::fs::remove_file(&path).unwrap();
        let e = f.token().unwrap_err();
        assert!(e.contains("cannot read the token file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
