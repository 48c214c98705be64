//! TLS (`rediss://`) and authentication failures: the URL's certificate options, and which
//! client errors mean the server refused who we are ([`ErrorKind::Auth`]).

use std::path::Path;

use onceflow_core::{Error, ErrorKind, Result};

/// URL options this module reads (`rediss://` only).
pub(crate) const TLS_OPTIONS: [&str; 3] = ["ca", "cert", "key"];

/// The `ca`, `cert` and `key` options of a URL: PEM file paths.
#[derive(Debug, Default)]
pub(crate) struct TlsFiles {
    pub(crate) ca: Option<String>,
    pub(crate) cert: Option<String>,
    pub(crate) key: Option<String>,
}

impl TlsFiles {
    pub(crate) fn set(&mut self, k: &str, v: String) {
        match k {
            "ca" => self.ca = Some(v),
            "cert" => self.cert = Some(v),
            "key" => self.key = Some(v),
            _ => {}
        }
    }

    pub(crate) fn any(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }

    /// Reads the files into the redis crate's [`redis::TlsCertificates`]. A file that cannot be
    /// read is a [`ErrorKind::Config`] error naming its path (never its contents).
    pub(crate) fn load(&self, shown: &str) -> Result<redis::TlsCertificates> {
        let read = |what: &str, path: &str| -> Result<Vec<u8>> {
            let bytes = std::fs::read(Path::new(path)).map_err(|e| {
                Error::config(format!(
                    "Redis store URL '{shown}': cannot read the {what} file '{path}': {e}"
                ))
            })?;
            if !String::from_utf8_lossy(&bytes).contains("-----BEGIN ") {
                return Err(Error::config(format!(
                    "Redis store URL '{shown}': the {what} file '{path}' is not PEM \
                     (no '-----BEGIN' line)"
                )));
            }
            Ok(bytes)
        };
        let client_tls = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => Some(redis::ClientTlsConfig {
                client_cert: read("client certificate (cert=)", c)?,
                client_key: read("client key (key=)", k)?,
            }),
            (None, None) => None,
            _ => {
                return Err(Error::config(format!(
                    "Redis store URL '{shown}': cert= and key= go together (the client \
                     certificate and its private key, PEM files)"
                )))
            }
        };
        let root_cert = match &self.ca {
            Some(p) => Some(read("CA certificate (ca=)", p)?),
            None => None,
        };
        Ok(redis::TlsCertificates {
            client_tls,
            root_cert,
        })
    }
}

/// rustls needs a process-wide crypto provider when more than one is compiled in (the redis
/// client builds its configuration with `ClientConfig::builder()`); installs *ring*'s unless
/// the application installed one already.
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Lost race with another thread installing one: theirs is used, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// If `e` (or what caused it) is a TLS failure, what the handshake refused, in words.
pub(crate) fn tls_failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = Some(e);
    while let Some(x) = cur {
        if let Some(r) = x.downcast_ref::<rustls::Error>() {
            return Some(describe(r));
        }
        if let Some(r) = x
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(describe(r));
        }
        cur = x.source();
    }
    None
}

fn describe(r: &rustls::Error) -> String {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E};
    match r {
        E::InvalidCertificate(C::UnknownIssuer) => format!(
            "TLS handshake refused: the server's certificate is not signed by a CA we trust \
             (give the CA's PEM file with ?ca=PATH): {r}"
        ),
        E::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => {
            format!(
                "TLS handshake refused: the server's certificate does not name the host in the \
                 URL: {r}"
            )
        }
        E::InvalidCertificate(_) => {
            format!("TLS handshake refused: the server's certificate is not valid: {r}")
        }
        E::AlertReceived(
            A::CertificateRequired
            | A::BadCertificate
            | A::UnknownCA
            | A::CertificateUnknown
            | A::CertificateRevoked
            | A::CertificateExpired
            | A::UnsupportedCertificate
            | A::AccessDenied,
        ) => format!(
            "TLS handshake refused by the server: it does not accept our client certificate \
             (give cert=PATH and key=PATH signed by a CA it trusts): {r}"
        ),
        _ => format!("TLS handshake failed: {r}"),
    }
}

/// Whether the server refused the credentials (Redis error codes `WRONGPASS`, `NOAUTH`,
/// `NOPERM`, or the client's own "authentication failed").
pub(crate) fn is_auth_refusal(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
}

/// The [`ErrorKind::Auth`] error for a refused credential or certificate.
pub(crate) fn auth_error(shown: &str, what: &str, e: &redis::RedisError) -> Option<Error> {
    if let Some(tls) = tls_failure(e) {
        return Some(Error::new(
            ErrorKind::Auth,
            format!("Redis store '{shown}': {what}: {tls}"),
        ));
    }
    if is_auth_refusal(e) {
        let hint = match e.code() {
            Some("NOAUTH") => "the server requires a user and password (give them in the URL)",
            Some("NOPERM") => "the ACL user may not run this command or touch these keys",
            _ => "the server refused the user name or password",
        };
        return Some(Error::new(
            ErrorKind::Auth,
            format!("Redis store '{shown}': {what}: {hint}: {e}"),
        ));
    }
    None
}
