//! TLS and passwords the way libpq takes them: `sslmode`, `sslrootcert`, `sslcert`, `sslkey`
//! and `passfile` in the URL, the password from the URL, else `PGPASSWORD`, else the password
//! file (`passfile=`, `PGPASSFILE` or `~/.pgpass`); rustls for the TLS (tokio-postgres-rustls),
//! and which failures mean the server refused us ([`ErrorKind::Auth`]).
//!
//! libpq's rules: <https://www.postgresql.org/docs/current/libpq-ssl.html> (SSL modes, table
//! 34.1), <https://www.postgresql.org/docs/current/libpq-pgpass.html> (the password file).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use onceflow_core::{Error, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's `sslmode`, with what each one checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// No TLS.
    Disable,
    /// TLS if the server offers it (the server is asked first); libpq's `allow` too.
    Prefer,
    /// TLS or nothing.
    Require,
    /// TLS, the server's chain checked against `sslrootcert`.
    VerifyCa,
    /// TLS, the chain checked and the certificate naming the host.
    VerifyFull,
}

impl Mode {
    fn parse(v: &str, shown: &str) -> Result<Mode> {
        Ok(match v {
            "disable" => Mode::Disable,
            "allow" | "prefer" => Mode::Prefer,
            "require" => Mode::Require,
            "verify-ca" => Mode::VerifyCa,
            "verify-full" => Mode::VerifyFull,
            other => {
                return Err(Error::config(format!(
                    "sslmode '{other}' in PostgreSQL store URL '{shown}': expected disable, \
                     allow, prefer, require, verify-ca or verify-full"
                )))
            }
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Disable => "disable",
            Mode::Prefer => "prefer",
            Mode::Require => "require",
            Mode::VerifyCa => "verify-ca",
            Mode::VerifyFull => "verify-full",
        }
    }
}

/// What the URL's query said about TLS and the password file.
#[derive(Debug, Default)]
pub(crate) struct Options {
    sslmode: Option<String>,
    sslrootcert: Option<String>,
    sslcert: Option<String>,
    sslkey: Option<String>,
    pub(crate) passfile: Option<String>,
}

impl Options {
    /// Takes this module's options out of `pairs`.
    pub(crate) fn take(pairs: &mut Vec<(String, String)>) -> Options {
        let mut o = Options::default();
        pairs.retain(|(k, v)| {
            let slot = match k.as_str() {
                "sslmode" => &mut o.sslmode,
                "sslrootcert" => &mut o.sslrootcert,
                "sslcert" => &mut o.sslcert,
                "sslkey" => &mut o.sslkey,
                "passfile" => &mut o.passfile,
                _ => return true,
            };
            *slot = Some(v.clone());
            false
        });
        o
    }
}

/// How connections are made: the mode and the rustls connector for it.
pub(crate) struct Security {
    pub(crate) mode: Mode,
    pub(crate) connector: MakeRustlsConnect,
}

/// *ring*, explicitly: no process-wide default provider is needed or installed.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_file(what: &str, path: &Path, shown: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        Error::config(format!(
            "PostgreSQL store URL '{shown}': cannot read the {what} '{}': {e}",
            path.display()
        ))
    })
}

fn home() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
}

/// The trusted roots: `sslrootcert=PATH` (PEM), `sslrootcert=system` (the system's store), or
/// libpq's default `~/.postgresql/root.crt` when it exists. `None`: no roots were named.
fn roots(o: &Options, shown: &str) -> Result<Option<RootCertStore>> {
    let path = match o.sslrootcert.as_deref() {
        Some("system") => {
            let found = rustls_native_certs::load_native_certs();
            let mut store = RootCertStore::empty();
            let (added, _) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(Error::config(format!(
                    "PostgreSQL store URL '{shown}': sslrootcert=system, but no certificate \
                     could be loaded from the system's store"
                )));
            }
            return Ok(Some(store));
        }
        Some(p) => PathBuf::from(p),
        None => match home().map(|h| h.join(".postgresql/root.crt")) {
            Some(p) if p.is_file() => p,
            _ => return Ok(None),
        },
    };
    let pem = read_file("root certificate file (sslrootcert)", &path, shown)?;
    let mut store = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| {
            Error::config(format!(
                "PostgreSQL store URL '{shown}': the root certificate file '{}' is not PEM: {e}",
                path.display()
            ))
        })?;
        store.add(cert).map_err(|e| {
            Error::config(format!(
                "PostgreSQL store URL '{shown}': a certificate in '{}' is not a usable CA \
                 certificate: {e}",
                path.display()
            ))
        })?;
    }
    if store.is_empty() {
        return Err(Error::config(format!(
            "PostgreSQL store URL '{shown}': the root certificate file '{}' holds no \
             certificate",
            path.display()
        )));
    }
    Ok(Some(store))
}

/// The client certificate and key (`sslcert`, `sslkey`: PEM files), both or neither.
#[allow(clippy::type_complexity)]
fn client_identity(
    o: &Options,
    shown: &str,
) -> Result<Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>> {
    let (cert, key) = match (&o.sslcert, &o.sslkey) {
        (None, None) => return Ok(None),
        (Some(c), Some(k)) => (PathBuf::from(c), PathBuf::from(k)),
        _ => {
            return Err(Error::config(format!(
                "PostgreSQL store URL '{shown}': sslcert and sslkey go together (the client \
                 certificate and its private key, PEM files)"
            )))
        }
    };
    let pem = read_file("client certificate (sslcert)", &cert, shown)?;
    let chain = CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| {
            Error::config(format!(
                "PostgreSQL store URL '{shown}': the client certificate '{}' is not PEM: {e}",
                cert.display()
            ))
        })?;
    if chain.is_empty() {
        return Err(Error::config(format!(
            "PostgreSQL store URL '{shown}': the client certificate '{}' holds no certificate",
            cert.display()
        )));
    }
    let pem = read_file("client key (sslkey)", &key, shown)?;
    // The key's bytes are never shown; only its path.
    let key_der = PrivateKeyDer::from_pem_slice(&pem).map_err(|_| {
        Error::config(format!(
            "PostgreSQL store URL '{shown}': the client key '{}' is not a PEM private key \
             (PKCS#8, PKCS#1 or SEC1)",
            key.display()
        ))
    })?;
    Ok(Some((chain, key_der)))
}

/// The mode and connector for the URL's options.
pub(crate) fn security(o: &Options, shown: &str) -> Result<Security> {
    let mode = match &o.sslmode {
        Some(v) => Mode::parse(v, shown)?,
        None => Mode::Prefer,
    };
    let roots = if mode == Mode::Disable {
        None
    } else {
        roots(o, shown)?
    };
    // libpq: with a root certificate, require checks the chain as verify-ca does.
    let verify = match (mode, &roots) {
        (Mode::VerifyFull, Some(r)) => Verify::Full(r.clone()),
        (Mode::VerifyCa, Some(r)) => Verify::Chain(r.clone()),
        (Mode::Prefer | Mode::Require, Some(r)) if o.sslrootcert.is_some() => {
            Verify::Chain(r.clone())
        }
        (Mode::VerifyCa | Mode::VerifyFull, None) => {
            return Err(Error::config(format!(
                "PostgreSQL store URL '{shown}': sslmode={} needs the CA that signed the \
                 server's certificate: give sslrootcert=PATH (a PEM file), sslrootcert=system \
                 for the system's trusted roots, or put it in ~/.postgresql/root.crt",
                mode.name()
            )))
        }
        _ => Verify::Nothing,
    };
    let provider = provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::config(format!("PostgreSQL store '{shown}': TLS setup: {e}")))?;
    let builder = match verify {
        Verify::Full(r) => builder.with_root_certificates(r),
        Verify::Chain(r) => {
            let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(r), provider)
                .build()
                .map_err(|e| {
                    Error::config(format!("PostgreSQL store '{shown}': TLS setup: {e}"))
                })?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly { inner }))
        }
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification { provider })),
    };
    let config = match client_identity(o, shown)? {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).map_err(|e| {
            Error::config(format!(
                "PostgreSQL store URL '{shown}': the client certificate and key do not go \
                 together: {e}"
            ))
        })?,
        None => builder.with_no_client_auth(),
    };
    Ok(Security {
        mode,
        connector: MakeRustlsConnect::new(config),
    })
}

/// tokio-postgres's mode for ours.
pub(crate) fn ssl_mode(mode: Mode) -> SslMode {
    match mode {
        Mode::Disable => SslMode::Disable,
        Mode::Prefer => SslMode::Prefer,
        Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
    }
}

enum Verify {
    Full(RootCertStore),
    Chain(RootCertStore),
    Nothing,
}

/// verify-ca: the chain must lead to a trusted root; the host name is not checked.
#[derive(Debug)]
struct ChainOnly {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        // webpki checks the name only once the chain is valid: a name error means the chain
        // passed.
        match self
            .inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// prefer / require without a root certificate (libpq's behaviour): encrypted, the server's
/// certificate not checked; the handshake's signatures still are.
#[derive(Debug)]
struct NoVerification {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Sets the password if the URL has none (`PGPASSWORD`, then the password file); returns where
/// it came from, in words, for error messages (never the password).
pub(crate) fn resolve_password(
    config: &mut tokio_postgres::Config,
    passfile: Option<&str>,
) -> String {
    if config.get_password().is_some() {
        return "password from the URL".into();
    }
    if let Some(p) = std::env::var("PGPASSWORD").ok().filter(|p| !p.is_empty()) {
        config.password(p);
        return "password from PGPASSWORD".into();
    }
    let path = match passfile
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("PGPASSFILE").map(PathBuf::from))
        .or_else(|| home().map(|h| h.join(".pgpass")))
    {
        Some(p) => p,
        None => return "no password (not in the URL, no PGPASSWORD, no HOME for ~/.pgpass)".into(),
    };
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        // libpq matches a Unix socket (or no host) as `localhost`.
        _ => "localhost".to_string(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config
        .get_user()
        .map(str::to_string)
        .or_else(|| std::env::var("USER").ok())
        .or_else(|| std::env::var("LOGNAME").ok())
        .unwrap_or_default();
    let db = config.get_dbname().unwrap_or(&user).to_string();
    match read_passfile(&path) {
        PassFile::Missing => format!(
            "no password (not in the URL, no PGPASSWORD, no password file at '{}')",
            path.display()
        ),
        PassFile::Unsafe(mode) => {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{mode:o}"),
                "PostgreSQL password file has group or world access: ignored (permissions \
                 should be u=rw, 0600, or less)"
            );
            format!(
                "no password: the password file '{}' was ignored, it has group or world \
                 access (mode {mode:o}; chmod 0600 it)",
                path.display()
            )
        }
        PassFile::Unreadable(e) => format!(
            "no password: the password file '{}' cannot be read ({e})",
            path.display()
        ),
        PassFile::Text(text) => match pgpass_lookup(&text, &host, port, &db, &user) {
            Some((line, pw)) => {
                config.password(pw);
                format!(
                    "password from the password file '{}' (line {line})",
                    path.display()
                )
            }
            None => format!(
                "no password (not in the URL, no PGPASSWORD, and no line for \
                 {host}:{port}:{db}:{user} in the password file '{}')",
                path.display()
            ),
        },
    }
}

enum PassFile {
    Missing,
    Unsafe(u32),
    Unreadable(std::io::Error),
    Text(String),
}

fn read_passfile(path: &Path) -> PassFile {
    let meta = match std::fs::metadata(path) {
        Ok(m) if m.is_file() => m,
        Ok(_) => return PassFile::Missing,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return PassFile::Missing,
        Err(e) => return PassFile::Unreadable(e),
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return PassFile::Unsafe(mode);
        }
    }
    #[cfg(not(unix))]
    let _ = meta;
    match std::fs::read_to_string(path) {
        Ok(t) => PassFile::Text(t),
        Err(e) => PassFile::Unreadable(e),
    }
}

/// libpq's password-file lookup: the first line `hostname:port:database:username:password`
/// whose first four fields match (`*` alone matches anything; `\` escapes `:` and `\`); lines
/// starting with `#` are comments. Returns the 1-based line number and the password.
pub(crate) fn pgpass_lookup(
    text: &str,
    host: &str,
    port: u16,
    db: &str,
    user: &str,
) -> Option<(usize, String)> {
    let port = port.to_string();
    for (n, line) in text.lines().enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let fields = split_fields(line);
        if fields.len() < 5 {
            continue;
        }
        let want = [host, port.as_str(), db, user];
        if fields[..4]
            .iter()
            .zip(want)
            .all(|((value, wild), w)| *wild || value == w)
        {
            return Some((n + 1, fields[4].0.clone()));
        }
    }
    None
}

/// The fields of a line, unescaped, each with whether it was a bare `*`. The fifth field (the
/// password) ends at the next unescaped `:` or the end of the line, as in libpq.
fn split_fields(line: &str) -> Vec<(String, bool)> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut raw_star = true;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                raw_star = false;
                if let Some(next) = chars.next() {
                    cur.push(next);
                }
            }
            ':' => {
                let wild = raw_star && cur == "*";
                fields.push((std::mem::take(&mut cur), wild));
                raw_star = true;
                if fields.len() == 5 {
                    return fields;
                }
            }
            c => cur.push(c),
        }
    }
    let wild = raw_star && cur == "*";
    fields.push((cur, wild));
    fields
}

/// If `e` (or what caused it) is a TLS failure, what the handshake refused, in words.
pub(crate) fn tls_failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = Some(e);
    while let Some(x) = cur {
        let found = x.downcast_ref::<rustls::Error>().or_else(|| {
            x.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(r) = found {
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
             (give the CA's PEM file with sslrootcert=PATH): {r}"
        ),
        E::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => format!(
            "TLS handshake refused: the server's certificate does not name the host in the URL \
             (sslmode=verify-full; verify-ca checks the CA only): {r}"
        ),
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
             (sslcert, sslkey): {r}"
        ),
        _ => format!("TLS handshake failed: {r}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "\
# comment:line:x:y:z
db.example:5432:app:alice:first
*:15433:onceflow:onceflow:wild-host
127.0.0.1:*:*:bob:pw\\:with\\:colons\\\\
h\\:x:1:d:u:escaped-host
\\*:2:d:u:literal-star
127.0.0.1:3:d:u:pw:ignored-rest
short:line
";

    #[test]
    fn pgpass_lines_match_with_wildcards_and_escapes() {
        let look = |h, p, d, u| pgpass_lookup(FILE, h, p, d, u);
        assert_eq!(
            look("db.example", 5432, "app", "alice"),
            Some((2, "first".into()))
        );
        assert_eq!(look("db.example", 5433, "app", "alice"), None);
        assert_eq!(
            look("anything", 15433, "onceflow", "onceflow"),
            Some((3, "wild-host".into()))
        );
        assert_eq!(
            look("127.0.0.1", 9, "x", "bob"),
            Some((4, "pw:with:colons\\".into()))
        );
        assert_eq!(look("h:x", 1, "d", "u"), Some((5, "escaped-host".into())));
        // An escaped `*` is a literal star, not a wildcard.
        assert_eq!(look("other", 2, "d", "u"), None);
        assert_eq!(look("*", 2, "d", "u"), Some((6, "literal-star".into())));
        // The password ends at the next unescaped colon.
        assert_eq!(look("127.0.0.1", 3, "d", "u"), Some((7, "pw".into())));
        assert_eq!(look("short", 1, "d", "u"), None);
        // A comment is never a match.
        assert_eq!(look("# comment", 0, "x", "y"), None);
        // CRLF line ends.
        assert_eq!(
            pgpass_lookup("h:1:d:u:pw\r\n", "h", 1, "d", "u"),
            Some((1, "pw".into()))
        );
    }

    #[test]
    fn sslmodes_parse_as_libpq_names_them() {
        for (v, m) in [
            ("disable", Mode::Disable),
            ("allow", Mode::Prefer),
            ("prefer", Mode::Prefer),
            ("require", Mode::Require),
            ("verify-ca", Mode::VerifyCa),
            ("verify-full", Mode::VerifyFull),
        ] {
            assert_eq!(Mode::parse(v, "u").unwrap(), m);
        }
        let e = Mode::parse("verify_full", "postgres://h/db").unwrap_err();
        assert_eq!(e.kind(), onceflow_core::ErrorKind::Config);
        assert!(e.message().contains("verify_full"), "{e}");
    }
}
