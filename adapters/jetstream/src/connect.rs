//! The connection: TLS and credentials handed to async-nats' own options, and connect errors
//! sorted into onceflow's kinds (`Auth` for refused credentials and certificates) without any
//! secret in their text.

use async_nats::rustls;
use async_nats::{ConnectError, ConnectErrorKind, ConnectOptions};
use onceflow_core::{Error, ErrorKind, Result};

use crate::config::{check_user_seed, JetStreamOptions};

/// async-nats' options for `options`, and what the credentials are, for error messages
/// ("user 'app' with a password", "NKey user UABC…", never the secret).
pub(crate) async fn connect_options(
    options: &JetStreamOptions,
) -> Result<(ConnectOptions, String)> {
    options.validate()?;
    // async-nats builds its TLS configuration on rustls's process-wide crypto provider, which
    // rustls cannot pick by itself when a build links both ring and aws-lc-rs (the AWS SDK
    // brings the latter: the facade with every platform, the Python and Node packages), and
    // panics. Install ring, what async-nats is built with, unless the application chose one.
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let mut co = ConnectOptions::new()
        .connection_timeout(options.request_timeout)
        .request_timeout(Some(options.request_timeout))
        .max_reconnects(None);
    // No `retry_on_initial_connect`: the first connect tries each server once and returns its
    // error (an authorization violation at once), each attempt bounded by the connection
    // timeout. Only a connection made once reconnects without end.
    if options.tls_required() {
        co = co.require_tls(true);
    }
    if let Some(ca) = &options.tls_ca {
        readable("tls_ca", ca)?;
        co = co.add_root_certificates(ca.into());
    }
    if let (Some(cert), Some(key)) = (&options.tls_cert, &options.tls_key) {
        readable("tls_cert", cert)?;
        readable("tls_key", key)?;
        co = co.add_client_certificate(cert.into(), key.into());
    }
    if options.tls_first {
        co = co.tls_first();
    }
    let mut what = if let (Some(u), Some(p)) = (&options.user, &options.password) {
        co = co.user_and_password(u.clone(), p.clone());
        format!("user '{}' with a password", onceflow_core::shown(u))
    } else if let Some(t) = &options.token {
        co = co.token(t.clone());
        "a token".to_string()
    } else if let Some(seed) = &options.nkey_seed {
        let kp = check_user_seed(seed, "nkey_seed")?;
        co = co.nkey(seed.trim().to_string());
        format!("NKey user {}", kp.public_key())
    } else if let Some(path) = &options.nkey_seed_file {
        let text = tokio::fs::read_to_string(path).await.map_err(|e| {
            Error::config(format!(
                "cannot read nkey_seed_file '{}': {}",
                onceflow_core::shown(path),
                e.kind()
            ))
        })?;
        // The seed line of the file (nsc's and `nk`'s `.nk` files hold it alone; comments and
        // blank lines around it are skipped).
        let seed = text
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with('S'))
            .unwrap_or("");
        let from = format!("nkey_seed_file '{}'", onceflow_core::shown(path));
        let kp = check_user_seed(seed, &from)?;
        co = co.nkey(seed.to_string());
        format!("NKey user {} (from {from})", kp.public_key())
    } else if let Some(path) = &options.creds {
        let shown = onceflow_core::shown(path);
        co = co.credentials_file(path).await.map_err(|e| {
            // async-nats names the file and what it could not parse, never its contents.
            Error::config(format!("cannot use NATS credentials file '{shown}': {e}"))
        })?;
        format!("the JWT user of creds file '{shown}'")
    } else {
        "a client without credentials".to_string()
    };
    if let Some(cert) = &options.tls_cert {
        what.push_str(&format!(
            " and client certificate '{}'",
            onceflow_core::shown(cert)
        ));
    }
    Ok((co, what))
}

/// A `Config` error naming the option and the path when the file cannot be read.
fn readable(key: &str, path: &str) -> Result<()> {
    std::fs::File::open(path).map(drop).map_err(|e| {
        Error::config(format!(
            "{key} '{}' cannot be read: {}",
            onceflow_core::shown(path),
            e.kind()
        ))
    })
}

/// The rustls error under an async-nats connect error (TLS handshake and alerts reach it as
/// an I/O error wrapping rustls' own).
fn rustls_error(e: &ConnectError) -> Option<&rustls::Error> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                if let Some(r) = inner.downcast_ref::<rustls::Error>() {
                    return Some(r);
                }
            }
        }
        cur = err.source();
    }
    None
}

/// Why a TLS handshake was refused, when it is about certificates (an `Auth` error), with
/// the option to look at.
fn certificate_refusal(e: &rustls::Error, options: &JetStreamOptions) -> Option<String> {
    use rustls::{AlertDescription as A, CertificateError as C};
    let ca = match &options.tls_ca {
        Some(ca) => format!("the CA in tls_ca '{}'", onceflow_core::shown(ca)),
        None => "the system's root CAs (no tls_ca given)".to_string(),
    };
    let refusal = match e {
        rustls::Error::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => {
            format!("the server's certificate is not signed by {ca}")
        }
        rustls::Error::InvalidCertificate(
            C::NotValidForName | C::NotValidForNameContext { .. },
        ) => "the server's certificate is not valid for the host name or IP of the URL".to_string(),
        rustls::Error::InvalidCertificate(C::Expired | C::ExpiredContext { .. }) => {
            "the server's certificate has expired".to_string()
        }
        rustls::Error::InvalidCertificate(c) => {
            format!("the server's certificate was refused ({c:?}), checked against {ca}")
        }
        rustls::Error::AlertReceived(A::CertificateRequired) => {
            "the server requires a client certificate (mutual TLS): give tls_cert and tls_key"
                .to_string()
        }
        rustls::Error::AlertReceived(
            a @ (A::BadCertificate
            | A::UnknownCA
            | A::CertificateUnknown
            | A::CertificateRevoked
            | A::CertificateExpired
            | A::UnsupportedCertificate
            | A::AccessDenied
            | A::HandshakeFailure),
        ) => {
            let cert = match &options.tls_cert {
                Some(c) => format!("client certificate '{}'", onceflow_core::shown(c)),
                None => "TLS handshake (no client certificate given)".to_string(),
            };
            format!("the server refused our {cert} (alert {a:?})")
        }
        _ => return None,
    };
    Some(refusal)
}

/// An async-nats connect error as onceflow's: `Auth` for refused credentials or certificates,
/// `Config` for a TLS setup that cannot be built (unreadable PEM files), `Connect` otherwise.
/// Names the servers (no user info) and the credentials' kind, never their value.
pub(crate) fn connect_error(e: ConnectError, options: &JetStreamOptions, what: &str) -> Error {
    let servers = onceflow_core::redact_credentials(&options.servers);
    let err = match e.kind() {
        ConnectErrorKind::AuthorizationViolation => Error::new(
            ErrorKind::Auth,
            format!(
                "NATS at {servers} refused {what}: authorization violation (wrong or unknown \
                 credentials, or none where the server requires them)"
            ),
        ),
        ConnectErrorKind::Authentication => Error::new(
            ErrorKind::Auth,
            format!("NATS at {servers}: could not sign the server's nonce with {what}"),
        ),
        ConnectErrorKind::Tls => Error::config(format!(
            "NATS at {servers}: the TLS client could not be set up (tls_ca, tls_cert, tls_key \
             must be PEM files): {e}"
        )),
        _ => match rustls_error(&e).and_then(|r| certificate_refusal(r, options)) {
            Some(refusal) => Error::new(
                ErrorKind::Auth,
                format!("NATS at {servers}: TLS handshake refused: {refusal} ({e})"),
            ),
            None => {
                let hint = if options.tls_required() && !options.tls_first {
                    " (if the server sets handshake_first, add tls_first=true)"
                } else if options.tls_first {
                    " (tls_first=true: does the server set handshake_first?)"
                } else {
                    ""
                };
                Error::new(
                    ErrorKind::Connect,
                    format!("cannot connect to NATS at {servers}: {e}{hint}"),
                )
            }
        },
    };
    err.with_source(e)
}
