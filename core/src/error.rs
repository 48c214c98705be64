//! One error type for every platform: an [`ErrorKind`], a message naming the value at fault,
//! whether a retry can succeed, and the native client's error as [`std::error::Error::source`].

use std::fmt;

/// Boxed error from a native client or a user handler, kept as the `source()` of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with onceflow's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, independent of the platform.
///
/// Bindings map each kind to one stable code: Python raises one subclass of
/// `onceflow.OnceflowError` per kind, Node throws an `Error` whose `code` is
/// [`ErrorKind::code`].
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Bad configuration or input: an unknown URL scheme, an invalid option, a negative count,
    /// an oversized message, a malformed header. Never retriable.
    Config,
    /// The platform or store was reached but refused who we are: a wrong password or token, an
    /// expired credential, an untrusted or mismatched TLS certificate, a SASL mechanism the
    /// server does not enable, or an ACL that denies the operation. Not retriable: the same
    /// credentials fail again. The message names the server and what was refused, never the
    /// secret itself.
    Auth,
    /// The platform or store could not be reached. Usually retriable.
    Connect,
    /// An operation did not finish in time; its outcome may be unknown (see [`Error::outcome_unknown`]).
    Timeout,
    /// This worker lost its right to act: a newer producer epoch took its transactional id, its
    /// lease or partition moved to another worker, or its fencing token is stale.
    Fenced,
    /// A transaction was aborted; nothing it wrote is visible to read-committed readers.
    Aborted,
    /// A payload, header or position could not be encoded or decoded.
    Serialization,
    /// The dedup (idempotency) store failed or refused an operation.
    DedupStore,
    /// The same idempotency key arrived with a different payload fingerprint.
    Conflict,
    /// The platform does not offer this capability (see `Capabilities`).
    Unsupported,
    /// A topic, stream, subscription or key does not exist.
    NotFound,
    /// A user handler or transform returned an error.
    Handler,
    /// The handle was closed or the engine is shutting down.
    Closed,
    /// Any other error reported by the platform's client.
    Platform,
}

impl ErrorKind {
    /// Every kind, in declaration order (for bindings that generate one class per kind).
    pub const ALL: [ErrorKind; 14] = [
        ErrorKind::Config,
        ErrorKind::Auth,
        ErrorKind::Connect,
        ErrorKind::Timeout,
        ErrorKind::Fenced,
        ErrorKind::Aborted,
        ErrorKind::Serialization,
        ErrorKind::DedupStore,
        ErrorKind::Conflict,
        ErrorKind::Unsupported,
        ErrorKind::NotFound,
        ErrorKind::Handler,
        ErrorKind::Closed,
        ErrorKind::Platform,
    ];

    /// Stable code string, e.g. `"ONCEFLOW_FENCED"`: Node's `err.code`, and the prefix of
    /// `Display`.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::Config => "ONCEFLOW_CONFIG",
            ErrorKind::Auth => "ONCEFLOW_AUTH",
            ErrorKind::Connect => "ONCEFLOW_CONNECT",
            ErrorKind::Timeout => "ONCEFLOW_TIMEOUT",
            ErrorKind::Fenced => "ONCEFLOW_FENCED",
            ErrorKind::Aborted => "ONCEFLOW_ABORTED",
            ErrorKind::Serialization => "ONCEFLOW_SERIALIZATION",
            ErrorKind::DedupStore => "ONCEFLOW_DEDUP_STORE",
            ErrorKind::Conflict => "ONCEFLOW_CONFLICT",
            ErrorKind::Unsupported => "ONCEFLOW_UNSUPPORTED",
            ErrorKind::NotFound => "ONCEFLOW_NOT_FOUND",
            ErrorKind::Handler => "ONCEFLOW_HANDLER",
            ErrorKind::Closed => "ONCEFLOW_CLOSED",
            ErrorKind::Platform => "ONCEFLOW_PLATFORM",
        }
    }

    /// The kind in words, for people reading a terminal or a log (e.g. `"bad input"` for
    /// [`ErrorKind::Config`]); [`ErrorKind::code`] is the stable identifier to match on.
    pub fn describe(self) -> &'static str {
        match self {
            ErrorKind::Config => "bad input",
            ErrorKind::Auth => "authentication failed",
            ErrorKind::Connect => "cannot connect",
            ErrorKind::Timeout => "timed out",
            ErrorKind::Fenced => "fenced",
            ErrorKind::Aborted => "transaction aborted",
            ErrorKind::Serialization => "cannot encode or decode",
            ErrorKind::DedupStore => "dedup store failed",
            ErrorKind::Conflict => "idempotency key conflict",
            ErrorKind::Unsupported => "not supported",
            ErrorKind::NotFound => "not found",
            ErrorKind::Handler => "handler failed",
            ErrorKind::Closed => "closed",
            ErrorKind::Platform => "platform error",
        }
    }

    /// Whether errors of this kind are retriable unless the constructor says otherwise.
    fn default_retriable(self) -> bool {
        matches!(self, ErrorKind::Connect | ErrorKind::Timeout)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// onceflow's error: a [`kind`](Error::kind), a message that names the value at fault, whether
/// retrying the same operation can succeed, and the native cause as `source()`.
///
/// Native client error types are never part of the public API; they are only reachable through
/// `source()`.
pub struct Error {
    kind: ErrorKind,
    message: String,
    retriable: bool,
    outcome_unknown: bool,
    source: Option<BoxError>,
}

impl Error {
    /// A new error of `kind` with a message naming the value at fault and what was expected.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            retriable: kind.default_retriable(),
            outcome_unknown: false,
            source: None,
        }
    }

    /// Shorthand for [`ErrorKind::Config`].
    pub fn config(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Config, message)
    }

    /// Shorthand for [`ErrorKind::Unsupported`].
    pub fn unsupported(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Unsupported, message)
    }

    /// Shorthand for [`ErrorKind::DedupStore`].
    pub fn dedup_store(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::DedupStore, message)
    }

    /// Wraps an error returned by a user handler or transform ([`ErrorKind::Handler`],
    /// retriable: the engine retries handlers with backoff).
    pub fn handler(source: impl Into<BoxError>) -> Self {
        let source = source.into();
        Error::new(ErrorKind::Handler, source.to_string())
            .with_source_box(source)
            .retriable(true)
    }

    /// Attaches the native cause.
    pub fn with_source(self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.with_source_box(Box::new(source))
    }

    /// Attaches an already boxed cause.
    pub fn with_source_box(mut self, source: BoxError) -> Self {
        self.source = Some(source);
        self
    }

    /// Overrides whether a retry of the same operation can succeed.
    pub fn retriable(mut self, retriable: bool) -> Self {
        self.retriable = retriable;
        self
    }

    /// Marks an operation whose outcome is unknown (a transaction commit that timed out:
    /// it may or may not have committed).
    pub fn with_outcome_unknown(mut self) -> Self {
        self.outcome_unknown = true;
        self
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, naming the value at fault.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether retrying the same operation can succeed.
    pub fn is_retriable(&self) -> bool {
        self.retriable
    }

    /// Whether the operation may have taken effect even though it reported failure.
    pub fn outcome_unknown(&self) -> bool {
        self.outcome_unknown
    }

    /// Prefixes the message with context, keeping kind, source and flags.
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.kind)
            .field("message", &self.message)
            .field("retriable", &self.retriable);
        if self.outcome_unknown {
            d.field("outcome_unknown", &true);
        }
        if let Some(s) = &self.source {
            d.field("source", &s.to_string());
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.code(), self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

/// The URL with its password replaced by `***`, whether in the user info or in a query
/// parameter such as libpq's `password=` (the input unchanged when it has none): what
/// onceflow's errors, logs and CLI output show of a store or broker URL. An unparsable URL
/// loses everything between `://` and its last `@`, to be safe, and text that is no URL
/// (libpq's `host=h password=pw`) keeps its keys but not the values of secret ones.
pub fn redact_url(url: &str) -> String {
    let base = match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        Ok(_) => url.to_string(),
        Err(_) => match (url.find("://"), url.rfind('@')) {
            (Some(s), Some(a)) if a > s => format!("{}***{}", &url[..s + 3], &url[a..]),
            _ => url.to_string(),
        },
    };
    // The query as written (no re-encoding), secret values hidden, and the user info of URLs
    // inside it (`?admin=http://user:pw@host`) too.
    let shown = redact_nested(&redact_pairs(&base));
    // A URL inside a percent-encoded value (`?admin=http%3A%2F%2Fu%3Apw%40h`) is only seen
    // decoded: then the query is rebuilt from the decoded, redacted values.
    match url::Url::parse(&shown) {
        Ok(mut u) if u.query_pairs().any(|(_, v)| hide_userinfo(&v, 0) != v) => {
            let pairs: Vec<(String, String)> = u
                .query_pairs()
                .map(|(k, v)| (k.into_owned(), hide_userinfo(&v, 0)))
                .collect();
            u.query_pairs_mut().clear().extend_pairs(pairs);
            u.to_string()
        }
        _ => shown,
    }
}

/// Hides the user info of every URL after the first one in `text` (URLs given as query
/// values): `http://user:pw@host` becomes `http://***@host`.
fn redact_nested(text: &str) -> String {
    hide_userinfo(text, 1)
}

/// Hides the user info of every URL in `text` but the first `keep` ones.
fn hide_userinfo(text: &str, keep: usize) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut seen = 0;
    while let Some(i) = rest.find("://") {
        out.push_str(&rest[..i + 3]);
        let tail = &rest[i + 3..];
        let end = tail
            .find(|c: char| {
                matches!(c, '@' | '/' | '?' | '&' | '#' | ',' | ';') || c.is_whitespace()
            })
            .unwrap_or(tail.len());
        if seen >= keep && tail[end..].starts_with('@') && &tail[..end] != "***" {
            out.push_str("***");
            rest = &tail[end..];
        } else {
            rest = tail;
        }
        seen += 1;
    }
    out.push_str(rest);
    out
}

/// Hides the values of secret keys in text that is not a parsable URL: libpq's `key=value`
/// connection strings (`host=h password=pw`, a value possibly in single quotes) and the query of
/// a malformed URL (`…?sslpassword=pw&…`).
fn redact_pairs(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(eq) = rest.find('=') {
        // libpq allows blanks around '='.
        let before = rest[..eq].trim_end();
        let key_start = before
            .rfind(|c: char| c.is_whitespace() || matches!(c, '?' | '&' | ';'))
            .map_or(0, |i| i + 1);
        out.push_str(&rest[..eq + 1]);
        let after = &rest[eq + 1..];
        if !is_secret_key(&before[key_start..]) {
            rest = after;
            continue;
        }
        let value = after.trim_start();
        out.push_str(&after[..after.len() - value.len()]);
        out.push_str("***");
        let end = if let Some(quoted) = value.strip_prefix('\'') {
            // libpq: a quoted value ends at the first quote not escaped by a backslash.
            let mut escaped = false;
            quoted
                .char_indices()
                .find(|&(_, c)| {
                    let end = c == '\'' && !escaped;
                    escaped = c == '\\' && !escaped;
                    end
                })
                .map_or(value.len(), |(i, _)| i + 2)
        } else {
            value
                .find(|c: char| c.is_whitespace() || matches!(c, '&' | ';' | '#'))
                .unwrap_or(value.len())
        };
        rest = &value[end..];
    }
    out.push_str(rest);
    out
}

/// [`redact_url`] for each of a comma-separated list of URLs or `HOST:PORT`s, also hiding a
/// user name that stands alone (`nats://TOKEN@host`: token authentication) or any user info
/// before a bare `HOST:PORT`: what errors show of a broker address list.
pub fn redact_credentials(urls: &str) -> String {
    urls.split(',')
        .map(|one| {
            let r = redact_url(one);
            let start = r.find("://").map_or(0, |i| i + 3);
            // Only an '@' of the authority: one in the path or query belongs to something else.
            let end = r[start..]
                .find(['/', '?', '#'])
                .map_or(r.len(), |i| start + i);
            match r[start..end].rfind('@').map(|i| start + i) {
                Some(at) if at > start && !r[start..at].ends_with(":***") => {
                    format!("{}***{}", &r[..start], &r[at..])
                }
                _ => r,
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether a query parameter or client property named `key` holds a secret whose value
/// [`redact_url`] hides and errors never show (libpq's `password`, librdkafka's
/// `sasl.password` and `ssl.key.password`, and the usual names of tokens and secrets).
pub fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    [
        "password",
        "passwd",
        "pass",
        "secret",
        "token",
        "sslpassword",
    ]
    .iter()
    .any(|s| k == *s)
        // librdkafka's `sasl.password`, `ssl.key.password`, `sasl.oauthbearer.client.secret`,
        // `ssl.key.pem`, and the `_secret` / `_token` / `secret_access_key` of other clients.
        || k.contains("password")
        || k.contains("passwd")
        || k.contains("secret")
        || k.ends_with("token")
        || k.ends_with("key.pem")
        // NATS' `nkey_seed` (an NKey's private half).
        || k.ends_with("seed")
        || k == "sasl.oauthbearer.config"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_property_secrets_and_nested_urls_are_hidden() {
        let r = redact_url("kafka://h:1?sasl.password=S3&ssl.key.password=S4&linger.ms=5");
        assert!(!r.contains("S3") && !r.contains("S4"), "{r}");
        assert!(r.contains("linger.ms=5"), "{r}");
        let r = redact_credentials("pulsar://127.0.0.1:6650?admin=http://bob:S5@127.0.0.1:8080");
        assert_eq!(r, "pulsar://127.0.0.1:6650?admin=http://***@127.0.0.1:8080");
        let r = redact_credentials("pulsar://127.0.0.1:6650?admin=http://127.0.0.1:8080");
        assert_eq!(r, "pulsar://127.0.0.1:6650?admin=http://127.0.0.1:8080");
        let r = redact_url("pulsar://h:6650?admin=http%3A%2F%2Fu%3AS6%40127.0.0.1%3A18080");
        assert!(!r.contains("S6"), "{r}");
        assert!(r.contains("127.0.0.1"), "{r}");
    }

    #[test]
    fn redact_url_hides_passwords_in_userinfo_and_query() {
        assert_eq!(
            redact_url("postgres://u:pw@127.0.0.1:15432/db"),
            "postgres://u:***@127.0.0.1:15432/db"
        );
        let r = redact_url("postgres://u@127.0.0.1:15432/db?password=s3cret&sslmode=disable");
        assert!(!r.contains("s3cret"), "{r}");
        assert!(
            r.contains("sslmode=disable") && r.contains("password=***"),
            "{r}"
        );
        let r = redact_url("kinesis://h:1?region=us-east-1&aws_secret_access_key=AKS");
        assert!(!r.contains("AKS") && r.contains("region=us-east-1"), "{r}");
        assert_eq!(
            redact_url("redis://127.0.0.1:16379/0"),
            "redis://127.0.0.1:16379/0"
        );
        assert_eq!(redact_url("/tmp/d.db"), "/tmp/d.db");
        // Secret query keys other than `password`, in any case.
        for url in [
            "postgres://u@h:1/db?sslpassword=s3cret&sslmode=require",
            "postgres://u@h:1/db?PassWord=s3cret",
            "redis://h:1/?token=s3cret",
            "nats://h:1?nkey_seed=s3cret",
        ] {
            let r = redact_url(url);
            assert!(!r.contains("s3cret") && r.contains("***"), "{url} -> {r}");
        }
    }

    #[test]
    fn redact_url_hides_secrets_of_unparsable_urls_and_key_value_strings() {
        assert_eq!(
            redact_url("host=h user=u password=s3cret dbname=d"),
            "host=h user=u password=*** dbname=d"
        );
        assert_eq!(
            redact_url("host=h password='s3 \\'cret' sslpassword = x port=1"),
            "host=h password=*** sslpassword = *** port=1"
        );
        for text in [
            "user=u password='s3cret",
            "postgres://u@[bad/db?sslpassword=s3cret&x=1",
            "postgres://u:s3cret@[bad/db",
            "password=s3cret",
        ] {
            let r = redact_url(text);
            assert!(!r.contains("s3cret"), "{text} -> {r}");
        }
        assert_eq!(redact_url("host=h port=1"), "host=h port=1");
        assert!(!redact_credentials("redis://s3cret@h:1").contains("s3cret"));
    }

    #[test]
    fn codes_are_unique_and_display_names_kind() {
        let mut codes: Vec<_> = ErrorKind::ALL.iter().map(|k| k.code()).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), ErrorKind::ALL.len());
        let e = Error::config("bad value 'x', expected a number");
        assert_eq!(
            e.to_string(),
            "ONCEFLOW_CONFIG: bad value 'x', expected a number"
        );
        assert!(!e.is_retriable());
        assert!(Error::new(ErrorKind::Timeout, "t").is_retriable());
    }

    #[test]
    fn source_is_chained() {
        let io = std::io::Error::other("disk full");
        let e = Error::dedup_store("write failed").with_source(io);
        let src = std::error::Error::source(&e).unwrap();
        assert_eq!(src.to_string(), "disk full");
    }
}

/// How many characters of a value an error message quotes before it cuts the rest.
const SHOWN_CHARS: usize = 80;

/// `value` for an error message: control characters escaped and, past 80 characters, cut
/// with the full length named (`abc…(100000 characters)`), so a huge bad value neither floods
/// a terminal nor a log line.
pub fn shown(value: &str) -> String {
    let mut out = String::with_capacity(value.len().min(SHOWN_CHARS * 2));
    for (count, c) in value.chars().enumerate() {
        if count == SHOWN_CHARS {
            let total = value.chars().count();
            out.push_str(&format!("…({total} characters)"));
            return out;
        }
        out.extend(c.escape_debug());
    }
    out
}

#[cfg(test)]
mod shown_tests {
    use super::shown;

    #[test]
    fn short_values_are_kept_and_long_ones_cut_with_their_length() {
        assert_eq!(shown("orders"), "orders");
        assert_eq!(shown("a\nb"), "a\\nb");
        let long = "x".repeat(100_000);
        let s = shown(&long);
        assert!(s.starts_with(&"x".repeat(80)), "{s}");
        assert!(s.ends_with("…(100000 characters)"), "{s}");
        assert!(s.len() < 120);
        // Cut on a character boundary, never inside one.
        assert_eq!(
            shown(&"é".repeat(81)),
            format!("{}…(81 characters)", "é".repeat(80))
        );
    }
}
