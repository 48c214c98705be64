//! `nats://` URL parsing and the typed options of the adapter.

use std::collections::BTreeMap;
use std::time::Duration;

use onceflow_core::{Error, Result};

/// Options of a `nats://host:port?key=value&…` (or `tls://…`) connection. Every key is listed
/// here; an unknown key is a [`onceflow_core::ErrorKind::Config`] error naming it.
///
/// `Debug` shows `***` for the password, token and NKey seed (the paths of files holding
/// secrets are shown: they are not secret).
#[derive(Clone, PartialEq, Eq)]
pub struct JetStreamOptions {
    /// Server address(es) handed to async-nats (`nats://host:port` or `tls://host:port`, comma
    /// separated), without user info: credentials from the URL are moved into the fields below.
    pub servers: String,
    /// `auto_create` (default `true`): producing to, or consuming from, a topic without a stream
    /// creates the stream (with `partitions` partitions). With `false` it is a `NotFound` error.
    pub auto_create: bool,
    /// `partitions` (default 1): partitions of streams created automatically.
    pub partitions: u32,
    /// `publish_timeout_ms` (default 5000): how long a publish waits for its ack before it is
    /// retried with the same `Nats-Msg-Id`.
    pub publish_timeout: Duration,
    /// `publish_retries` (default 3): retries of a publish that timed out (same `Nats-Msg-Id`).
    pub publish_retries: u32,
    /// `request_timeout_ms` (default 5000): JetStream API requests (stream/consumer info, …),
    /// and the time one connection attempt to one server may take (TCP, TLS handshake,
    /// authentication).
    pub request_timeout: Duration,
    /// `ack_wait_ms` (default 30000): consumer `ack_wait`; a delivered message not acked (or
    /// marked in progress) for this long is redelivered.
    pub ack_wait: Duration,
    /// `max_deliver` (default -1 = unlimited): consumer `max_deliver`.
    pub max_deliver: i64,
    /// `max_ack_pending` (default 10000): consumer `max_ack_pending`.
    pub max_ack_pending: i64,
    /// `backoff_ms` (default none): consumer `backoff`, comma separated ms, used by the server
    /// for redeliveries after `ack_wait` expiries.
    pub backoff: Vec<Duration>,
    /// Which of the durable's settings (`ack_wait_ms`, `max_deliver`, `max_ack_pending`,
    /// `backoff_ms`) were given (in the URL or the consumer's options) rather than left at
    /// their defaults: reopening an existing durable brings only these to the given values, so
    /// a member or a CLI run that gives none does not reset another's settings to the defaults.
    pub durable_settings_given: Vec<&'static str>,
    /// `duplicate_window_ms` (default: the server's, 2 min): duplicate window of created
    /// streams.
    pub duplicate_window: Option<Duration>,
    /// `allow_atomic` (default `true`): created streams allow atomic batch publish (ADR-50).
    pub allow_atomic: bool,
    /// `storage` (`file` default, or `memory`): storage of created streams.
    pub memory_storage: bool,
    /// `fetch_batch` (default 256): messages asked per pull request.
    pub fetch_batch: usize,
    /// `pull_expires_ms` (default 500, at least 100): how long one pull request waits on the
    /// server for messages (its `expires`). A partition given up waits for the request in
    /// flight to end, so a longer expiry makes hand-overs slower.
    pub pull_expires: Duration,
    /// `idle_heartbeat_ms` (default 0 = none): the pull request's `idle_heartbeat`: while a
    /// request waits without a message, the server sends a heartbeat this often, until it ends
    /// the request (a 408 status at its expiry). A request that hears nothing from the server
    /// for two heartbeats (at least 500 ms) lost its server (a restart, a server that hangs)
    /// or its connection, whatever its expiry: it is given up, said once in a warning, and
    /// made again once connected. Without a heartbeat a request is given up only 5 s after its
    /// expiry (async-nats' batch timeout): after a server restart a consumer reads again
    /// within about max(2 × heartbeat, 500 ms) instead of `pull_expires_ms` + 5 s. An idle
    /// stream on a healthy server is not taken for a dead one. At most half of
    /// `pull_expires_ms` (the server refuses a longer one), at least 10 ms
    /// ([pull requests](https://docs.nats.io/reference/reference-protocols/nats_api_reference#fetching-from-a-pull-consumer),
    /// [ADR-37](https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-37.md)).
    pub idle_heartbeat: Option<Duration>,
    /// `reset` (default `false`): a consumer with an explicit start (`Earliest`, `Latest`, a
    /// position or a timestamp) deletes the group's existing durables of its partitions and
    /// creates them again at that start: the group's progress (ack floor) is forgotten.
    /// Without it an explicit start applies to durables created now only, and an existing
    /// durable is resumed at its ack floor (a warning says so), as Kafka's
    /// `auto.offset.reset` applies only to a group without committed offsets. Every member
    /// that joins with `reset=true` resets: give it to one run only.
    pub reset: bool,
    /// `require_durable` (default `false`): the application needs an acknowledged write to
    /// survive a server crash. A topic whose stream cannot promise that (memory storage, or a
    /// file stream whose server's `sync_interval` clients cannot read, see
    /// [`crate::DurabilityReport`]) gets a warning when it is first used.
    pub require_durable: bool,
    /// `dead_letter` (default none): a topic; with `max_deliver` > 0 a consumer republishes a
    /// message the server gave up on (its `MAX_DELIVERIES` advisory) to it, with the reason in
    /// headers, and terminates it.
    pub dead_letter: Option<String>,
    /// `tls` (default `false`; `true` for a `tls://` URL or when any other `tls_*` key is
    /// given): TLS is required, whatever the server's `INFO` says (async-nats'
    /// `require_tls`). With `false` the connection still upgrades to TLS when the server
    /// requires it.
    pub tls: bool,
    /// `tls_ca`: path of a PEM file of the CA certificate(s) that sign the server's
    /// certificate. When given, only these are trusted (not the system's roots).
    pub tls_ca: Option<String>,
    /// `tls_cert`: path of the PEM client certificate (chain) for mutual TLS; needs `tls_key`.
    pub tls_cert: Option<String>,
    /// `tls_key`: path of the PEM private key of `tls_cert`.
    pub tls_key: Option<String>,
    /// `tls_first` (default `false`): start TLS before the server's `INFO`, for servers
    /// configured with `handshake_first` (nats-server ≥ 2.10.4).
    pub tls_first: bool,
    /// `user` (with `password`, or the URL's `nats://user:password@host`): user + password
    /// authentication.
    pub user: Option<String>,
    /// `password`: see `user`.
    pub password: Option<String>,
    /// `token` (or the URL's `nats://TOKEN@host`): token authentication.
    pub token: Option<String>,
    /// `nkey_seed`: an NKey user seed (`SU…`, 58 characters): NKey authentication (the server
    /// knows the public key `U…`).
    pub nkey_seed: Option<String>,
    /// `nkey_seed_file`: path of a file holding an NKey user seed (read at connect time).
    pub nkey_seed_file: Option<String>,
    /// `creds`: path of a `.creds` file (user JWT + NKey seed, as `nsc generate creds` writes
    /// it): decentralized JWT authentication.
    pub creds: Option<String>,
}

impl std::fmt::Debug for JetStreamOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fn hidden(v: &Option<String>) -> Option<&'static str> {
            v.as_ref().map(|_| "***")
        }
        f.debug_struct("JetStreamOptions")
            .field("servers", &self.servers)
            .field("auto_create", &self.auto_create)
            .field("partitions", &self.partitions)
            .field("publish_timeout", &self.publish_timeout)
            .field("publish_retries", &self.publish_retries)
            .field("request_timeout", &self.request_timeout)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("backoff", &self.backoff)
            .field("durable_settings_given", &self.durable_settings_given)
            .field("duplicate_window", &self.duplicate_window)
            .field("allow_atomic", &self.allow_atomic)
            .field("memory_storage", &self.memory_storage)
            .field("fetch_batch", &self.fetch_batch)
            .field("pull_expires", &self.pull_expires)
            .field("idle_heartbeat", &self.idle_heartbeat)
            .field("reset", &self.reset)
            .field("require_durable", &self.require_durable)
            .field("dead_letter", &self.dead_letter)
            .field("tls", &self.tls)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("tls_first", &self.tls_first)
            .field("user", &self.user)
            .field("password", &hidden(&self.password))
            .field("token", &hidden(&self.token))
            .field("nkey_seed", &hidden(&self.nkey_seed))
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("creds", &self.creds)
            .finish()
    }
}

impl Default for JetStreamOptions {
    fn default() -> Self {
        JetStreamOptions {
            servers: "nats://127.0.0.1:4222".to_string(),
            auto_create: true,
            partitions: 1,
            publish_timeout: Duration::from_secs(5),
            publish_retries: 3,
            request_timeout: Duration::from_secs(5),
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            max_ack_pending: 10_000,
            backoff: Vec::new(),
            durable_settings_given: Vec::new(),
            duplicate_window: None,
            allow_atomic: true,
            memory_storage: false,
            fetch_batch: 256,
            pull_expires: Duration::from_millis(500),
            idle_heartbeat: None,
            reset: false,
            require_durable: false,
            dead_letter: None,
            tls: false,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_first: false,
            user: None,
            password: None,
            token: None,
            nkey_seed: None,
            nkey_seed_file: None,
            creds: None,
        }
    }
}

fn parse_num<T: std::str::FromStr>(key: &str, value: &str, what: &str) -> Result<T> {
    value
        .parse::<T>()
        .map_err(|_| Error::config(format!("'{key}={value}': expected {what}")))
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(Error::config(format!(
            "'{key}={value}': expected true or false"
        ))),
    }
}

/// The longest duration an option takes: 100 years (the server keeps durations as `i64`
/// nanoseconds, about 292 years; a larger value wrapped into another duration).
const MAX_MS: u64 = 100 * 365 * 24 * 3600 * 1000;

fn ms(key: &str, value: &str) -> Result<Duration> {
    let v = parse_num::<u64>(key, value, "a duration in milliseconds")?;
    if v > MAX_MS {
        return Err(Error::config(format!(
            "'{key}={value}': expected a duration in milliseconds up to {MAX_MS} (100 years)"
        )));
    }
    Ok(Duration::from_millis(v))
}

/// [`ms`] that must not be 0: a zero ack wait or timeout is the server's default or an instant
/// failure, never what was meant.
fn positive_ms(key: &str, value: &str) -> Result<Duration> {
    let d = ms(key, value)?;
    if d.is_zero() {
        return Err(Error::config(format!(
            "'{key}={value}': expected a positive duration in milliseconds"
        )));
    }
    Ok(d)
}

/// The keys of the connection itself (TLS and credentials): valid in the URL (or the typed
/// options), not among a consumer's options, which cannot change a connection made already.
pub const CONNECTION_KEYS: [&str; 11] = [
    "tls",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "tls_first",
    "user",
    "password",
    "token",
    "nkey_seed",
    "nkey_seed_file",
    "creds",
];

/// A non-empty value; a secret's is never shown.
fn non_empty(key: &str, value: &str) -> Result<Option<String>> {
    if value.is_empty() {
        return Err(Error::config(format!("'{key}' is empty: expected a value")));
    }
    Ok(Some(value.to_string()))
}

/// Whether `seed` is an NKey *user* seed (`SU…`); the error never shows it.
pub(crate) fn check_user_seed(seed: &str, from: &str) -> Result<nkeys::KeyPair> {
    match nkeys::KeyPair::from_seed(seed.trim()) {
        Ok(kp) if kp.public_key().starts_with('U') => Ok(kp),
        Ok(_) => Err(Error::config(format!(
            "{from} holds an NKey seed that is not a user's: expected a user seed (SU…)"
        ))),
        Err(_) => Err(Error::config(format!(
            "{from} is not an NKey seed: expected a user seed (SU…, 58 characters, as `nsc` or \
             `nk -gen user` writes it)"
        ))),
    }
}

/// Sets `field` from the URL's user info, refusing a different value given in the query too.
fn merge(field: &mut Option<String>, value: String, key: &str) -> Result<()> {
    match field {
        Some(v) if *v != value => Err(Error::config(format!(
            "'{key}' is given twice with different values: in the URL's user info and as \
             ?{key}="
        ))),
        _ => {
            *field = Some(value);
            Ok(())
        }
    }
}

impl JetStreamOptions {
    /// Applies one `key=value` option (a URL query parameter).
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        for given in [
            "ack_wait_ms",
            "max_deliver",
            "max_ack_pending",
            "backoff_ms",
        ] {
            if key == given && !self.durable_settings_given.contains(&given) {
                self.durable_settings_given.push(given);
            }
        }
        match key {
            "auto_create" => self.auto_create = parse_bool(key, value)?,
            "partitions" => {
                self.partitions = parse_num(key, value, "a partition count >= 1")?;
                if self.partitions == 0 {
                    return Err(Error::config(format!(
                        "'{key}={value}': expected a partition count >= 1"
                    )));
                }
            }
            "publish_timeout_ms" => self.publish_timeout = positive_ms(key, value)?,
            "publish_retries" => self.publish_retries = parse_num(key, value, "a count")?,
            "request_timeout_ms" => self.request_timeout = positive_ms(key, value)?,
            "ack_wait_ms" => self.ack_wait = positive_ms(key, value)?,
            "max_deliver" => self.max_deliver = parse_num(key, value, "a count or -1")?,
            "max_ack_pending" => self.max_ack_pending = parse_num(key, value, "a count or -1")?,
            "backoff_ms" => {
                self.backoff = value
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|v| ms(key, v))
                    .collect::<Result<_>>()?
            }
            "duplicate_window_ms" => self.duplicate_window = Some(ms(key, value)?),
            "allow_atomic" => self.allow_atomic = parse_bool(key, value)?,
            "storage" => {
                self.memory_storage = match value {
                    "file" => false,
                    "memory" => true,
                    _ => {
                        return Err(Error::config(format!(
                            "'{key}={value}': expected file or memory"
                        )))
                    }
                }
            }
            "fetch_batch" => {
                self.fetch_batch = parse_num(key, value, "a count >= 1")?;
                if self.fetch_batch == 0 {
                    return Err(Error::config(format!("'{key}={value}': expected >= 1")));
                }
            }
            "pull_expires_ms" => {
                let d = ms(key, value)?;
                if d < Duration::from_millis(100) {
                    return Err(Error::config(format!(
                        "'{key}={value}': expected at least 100 ms"
                    )));
                }
                self.pull_expires = d;
            }
            "idle_heartbeat_ms" => {
                let d = ms(key, value)?;
                self.idle_heartbeat = if d.is_zero() {
                    None
                } else if d < Duration::from_millis(10) {
                    return Err(Error::config(format!(
                        "'{key}={value}': expected 0 (none) or at least 10 ms"
                    )));
                } else {
                    Some(d)
                };
            }
            "reset" => self.reset = parse_bool(key, value)?,
            "require_durable" => self.require_durable = parse_bool(key, value)?,
            "dead_letter" => {
                crate::naming::check_topic(value)?;
                self.dead_letter = Some(value.to_string())
            }
            "tls" => self.tls = parse_bool(key, value)?,
            "tls_ca" => self.tls_ca = non_empty(key, value)?,
            "tls_cert" => self.tls_cert = non_empty(key, value)?,
            "tls_key" => self.tls_key = non_empty(key, value)?,
            "tls_first" => self.tls_first = parse_bool(key, value)?,
            "user" => self.user = non_empty(key, value)?,
            "password" => self.password = non_empty(key, value)?,
            "token" => self.token = non_empty(key, value)?,
            "nkey_seed" => self.nkey_seed = non_empty(key, value)?,
            "nkey_seed_file" => self.nkey_seed_file = non_empty(key, value)?,
            "creds" => self.creds = non_empty(key, value)?,
            other => {
                return Err(Error::config(format!(
                    "unknown nats option '{}': expected one of auto_create, partitions, \
                     publish_timeout_ms, publish_retries, request_timeout_ms, ack_wait_ms, \
                     max_deliver, max_ack_pending, backoff_ms, duplicate_window_ms, allow_atomic, \
                     storage, fetch_batch, pull_expires_ms, idle_heartbeat_ms, reset, \
                     require_durable, dead_letter, {}",
                    onceflow_core::shown(other),
                    CONNECTION_KEYS.join(", ")
                )))
            }
        }
        Ok(())
    }

    /// Applies a consumer's options ([`onceflow_core::ConsumerConfig::options`]): any key of
    /// [`JetStreamOptions::set`] but the [`CONNECTION_KEYS`], which are a `Config` error there
    /// (the connection is made already).
    pub fn apply(&mut self, options: &BTreeMap<String, String>) -> Result<()> {
        for (k, v) in options {
            if CONNECTION_KEYS.contains(&k.as_str()) {
                return Err(Error::config(format!(
                    "'{k}' is an option of the connection, not of a consumer: give it in the \
                     nats:// URL"
                )));
            }
            self.set(k, v)?;
        }
        self.check_heartbeat()
    }

    /// The idle heartbeat fits in a pull request: at most half its expiry (the server refuses
    /// a pull request whose heartbeat is longer).
    fn check_heartbeat(&self) -> Result<()> {
        match self.idle_heartbeat {
            Some(hb) if hb > self.pull_expires / 2 => Err(Error::config(format!(
                "idle_heartbeat_ms={} must be at most half of \
                 pull_expires_ms={}: raise pull_expires_ms or lower the heartbeat",
                hb.as_millis(),
                self.pull_expires.as_millis()
            ))),
            _ => Ok(()),
        }
    }

    /// Whether TLS is required: `tls`, a `tls://` server, or any `tls_*` option.
    pub fn tls_required(&self) -> bool {
        self.tls
            || self.tls_first
            || self.tls_ca.is_some()
            || self.tls_cert.is_some()
            || self.tls_key.is_some()
            || self.servers.split(',').any(|s| s.starts_with("tls://"))
    }

    /// The authentication methods given, by option name.
    fn auth_methods(&self) -> Vec<&'static str> {
        let mut m = Vec::new();
        if self.user.is_some() || self.password.is_some() {
            m.push("user/password");
        }
        if self.token.is_some() {
            m.push("token");
        }
        if self.nkey_seed.is_some() {
            m.push("nkey_seed");
        }
        if self.nkey_seed_file.is_some() {
            m.push("nkey_seed_file");
        }
        if self.creds.is_some() {
            m.push("creds");
        }
        m
    }

    /// Checks the servers and the combination of TLS and credential options (files are read
    /// at connect time). `Config` naming what is wrong; never a secret's value.
    pub fn validate(&self) -> Result<()> {
        self.check_heartbeat()?;
        for s in self.servers.split(',') {
            let addr: async_nats::ServerAddr = s.parse().map_err(|e| {
                Error::config(format!(
                    "NATS server '{}' is not valid: {e}",
                    onceflow_core::shown(&onceflow_core::redact_credentials(s))
                ))
            })?;
            if addr.has_user_pass() {
                return Err(Error::config(format!(
                    "NATS server '{}' carries credentials in JetStreamOptions::servers: give them \
                     as user/password or token",
                    onceflow_core::shown(&onceflow_core::redact_credentials(s))
                )));
            }
            if addr.is_websocket() {
                return Err(Error::config(format!(
                    "NATS server '{}': websocket servers are not supported by onceflow, expected \
                     nats:// or tls://",
                    onceflow_core::shown(s)
                )));
            }
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(Error::config(
                "mutual TLS needs both tls_cert (the client certificate) and tls_key (its \
                 private key)",
            ));
        }
        if self.user.is_some() != self.password.is_some() {
            return Err(Error::config(
                "user/password authentication needs both a user and a password \
                 (nats://user:password@host, or ?user=…&password=…)",
            ));
        }
        let methods = self.auth_methods();
        if methods.len() > 1 {
            return Err(Error::config(format!(
                "NATS credentials given more than once ({}): use one of user/password, token, \
                 nkey_seed, nkey_seed_file or creds",
                methods.join(", ")
            )));
        }
        if let Some(seed) = &self.nkey_seed {
            check_user_seed(seed, "nkey_seed")?;
        }
        Ok(())
    }
}

/// Parses `nats://host:port[,host:port]?key=value&…` or `tls://…`, credentials in the user
/// info (`nats://user:password@host`, `nats://TOKEN@host`) or the query. `Config` errors
/// name the offending part, never a secret.
pub fn parse_url(url: &str) -> Result<JetStreamOptions> {
    let (scheme, rest) = if let Some(r) = url.strip_prefix("nats://") {
        ("nats", r)
    } else if let Some(r) = url.strip_prefix("tls://") {
        ("tls", r)
    } else {
        let shown = match url.split_once("://") {
            Some((s, _)) => format!("a {}:// URL", onceflow_core::shown(s)),
            None => "not a URL".to_string(),
        };
        return Err(Error::config(format!(
            "{shown} is not a NATS URL: expected nats://host:port?key=value or tls://host:port"
        )));
    };
    let (hosts, query) = match rest.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (rest, None),
    };
    let hosts = hosts.trim_end_matches('/');
    if hosts.is_empty() {
        return Err(Error::config(format!(
            "the {scheme}:// URL names no server: expected {scheme}://host:port"
        )));
    }
    let mut userinfo: Option<&str> = None;
    let mut servers = Vec::new();
    for (i, entry) in hosts.split(',').enumerate() {
        // A server may repeat the scheme (`nats://a:4222,nats://b:4222`), but not change it.
        let entry = match entry.split_once("://") {
            Some((s, e)) if s == scheme => e,
            Some((s, _)) => {
                return Err(Error::config(format!(
                    "server {} of the URL is {}:// while the URL is {scheme}://: give every \
                     server the same scheme (tls://, or nats://…?tls=true for TLS)",
                    i + 1,
                    onceflow_core::shown(s)
                )))
            }
            None => entry,
        };
        let (info, hostport) = match entry.rfind('@') {
            Some(at) => (Some(&entry[..at]), &entry[at + 1..]),
            None => (None, entry),
        };
        let hostport = hostport.trim_end_matches('/');
        if hostport.is_empty() {
            return Err(Error::config(format!(
                "server {} of the URL names no host: expected {scheme}://host:port",
                i + 1
            )));
        }
        if let Some(info) = info {
            match userinfo {
                Some(prev) if prev != info => {
                    return Err(Error::config(
                        "the servers of the URL carry different credentials: give them once \
                         (one connection authenticates the same way to every server)",
                    ))
                }
                _ => userinfo = Some(info),
            }
        }
        servers.push(format!("{scheme}://{hostport}"));
    }
    let mut opts = JetStreamOptions {
        servers: servers.join(","),
        tls: scheme == "tls",
        ..Default::default()
    };
    let mut tls_off = false;
    if let Some(q) = query {
        for (k, v) in url::form_urlencoded::parse(q.as_bytes()) {
            opts.set(&k, &v)?;
            if k == "tls" {
                tls_off = !opts.tls;
            }
        }
    }
    if tls_off {
        if scheme == "tls" {
            return Err(Error::config(
                "tls=false contradicts the tls:// scheme: use nats:// for plain connections",
            ));
        }
        let with: Vec<&str> = [
            ("tls_ca", opts.tls_ca.is_some()),
            ("tls_cert", opts.tls_cert.is_some()),
            ("tls_key", opts.tls_key.is_some()),
            ("tls_first", opts.tls_first),
        ]
        .iter()
        .filter(|(_, on)| *on)
        .map(|(k, _)| *k)
        .collect();
        if !with.is_empty() {
            return Err(Error::config(format!(
                "tls=false contradicts {}: drop tls=false, or the TLS options",
                with.join(", ")
            )));
        }
    }
    opts.tls = opts.tls_required();
    if let Some(info) = userinfo {
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|_| Error::config("the URL's user info is not UTF-8 once decoded"))
        };
        match info.split_once(':') {
            Some((u, p)) => {
                merge(&mut opts.user, decode(u)?, "user")?;
                merge(&mut opts.password, decode(p)?, "password")?;
            }
            // `nats://alice@host?password=…`: the user; `nats://TOKEN@host`: a token (as
            // nats.go and the nats CLI read it).
            None if opts.password.is_some() && opts.token.is_none() => {
                merge(&mut opts.user, decode(info)?, "user")?
            }
            None => merge(&mut opts.token, decode(info)?, "token")?,
        }
        if [&opts.user, &opts.password, &opts.token]
            .iter()
            .any(|v| v.as_deref() == Some(""))
        {
            return Err(Error::config(
                "the URL's user info has an empty part: expected user:password@ or TOKEN@",
            ));
        }
    }
    opts.validate()?;
    Ok(opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A user seed made for these tests (`nkeys::KeyPair::new_user()`), and an account seed.
    fn user_seed() -> String {
        nkeys::KeyPair::new_user().seed().unwrap()
    }

    #[test]
    fn parses_hosts_and_options() {
        let o = parse_url("nats://127.0.0.1:14222?partitions=3&ack_wait_ms=500&backoff_ms=10,20")
            .unwrap();
        assert_eq!(o.servers, "nats://127.0.0.1:14222");
        assert_eq!(o.partitions, 3);
        assert_eq!(o.ack_wait, Duration::from_millis(500));
        assert_eq!(o.backoff.len(), 2);
        assert!(!o.tls);
        let e = parse_url("nats://h:1?bogus=1").unwrap_err();
        assert!(e.message().contains("bogus"));
        assert!(parse_url("kafka://h:1").is_err());
        assert!(parse_url("nats://h:1?partitions=0").is_err());
    }

    #[test]
    fn several_servers_keep_working() {
        let o = parse_url("nats://a:4222,b:4223/").unwrap();
        assert_eq!(o.servers, "nats://a:4222,nats://b:4223");
        let o = parse_url("nats://a:4222,nats://b:4223").unwrap();
        assert_eq!(o.servers, "nats://a:4222,nats://b:4223");
        let o = parse_url("tls://a:4222,b:4223?tls_ca=/ca.pem").unwrap();
        assert_eq!(o.servers, "tls://a:4222,tls://b:4223");
        let e = parse_url("nats://a:4222,tls://b:4223").unwrap_err();
        assert!(e.message().contains("same scheme"), "{e}");
        let e = parse_url("nats://a:4222,").unwrap_err();
        assert!(e.message().contains("server 2"), "{e}");
    }

    #[test]
    fn tls_from_the_scheme_the_flag_or_any_tls_key() {
        let o = parse_url("tls://127.0.0.1:14223").unwrap();
        assert!(o.tls && o.tls_required());
        assert_eq!(o.servers, "tls://127.0.0.1:14223");
        assert!(parse_url("nats://h:1?tls=true").unwrap().tls);
        let o = parse_url("nats://h:1?tls_ca=/etc/ca.pem").unwrap();
        assert!(o.tls);
        assert_eq!(o.tls_ca.as_deref(), Some("/etc/ca.pem"));
        let o = parse_url("nats://h:1?tls_first=true").unwrap();
        assert!(o.tls && o.tls_first);
        let o = parse_url("tls://h:1?tls_cert=/c.pem&tls_key=/c.key").unwrap();
        assert_eq!(o.tls_cert.as_deref(), Some("/c.pem"));
        assert_eq!(o.tls_key.as_deref(), Some("/c.key"));
        for (url, says) in [
            ("tls://h:1?tls=false", "tls://"),
            ("nats://h:1?tls=false&tls_ca=/ca.pem", "tls_ca"),
            ("nats://h:1?tls_cert=/c.pem", "tls_key"),
            ("nats://h:1?tls_key=/c.key", "tls_cert"),
            ("nats://h:1?tls=maybe", "tls=maybe"),
            ("nats://h:1?tls_ca=", "tls_ca"),
        ] {
            let e = parse_url(url).unwrap_err();
            assert_eq!(e.kind(), onceflow_core::ErrorKind::Config, "{url}");
            assert!(e.message().contains(says), "{url}: {e}");
        }
    }

    #[test]
    fn credentials_from_user_info_or_query_never_in_errors_or_debug() {
        let o = parse_url("nats://app:S3cr%40t@127.0.0.1:4222").unwrap();
        assert_eq!(o.user.as_deref(), Some("app"));
        assert_eq!(o.password.as_deref(), Some("S3cr@t"));
        assert_eq!(o.servers, "nats://127.0.0.1:4222", "no user info left");
        let o = parse_url("tls://app@h:1?password=S3cret").unwrap();
        assert_eq!(o.user.as_deref(), Some("app"));
        assert_eq!(o.password.as_deref(), Some("S3cret"));
        let o = parse_url("nats://?user=app&password=S3cret").unwrap_err();
        assert!(o.message().contains("names no server"), "{o}");
        let o = parse_url("nats://h:1?user=app&password=S3cret").unwrap();
        assert_eq!(o.user.as_deref(), Some("app"));
        let o = parse_url("nats://T0ken@a:1,T0ken@b:2").unwrap();
        assert_eq!(o.token.as_deref(), Some("T0ken"));
        assert_eq!(o.servers, "nats://a:1,nats://b:2");
        let o = parse_url("nats://h:1?token=T0ken").unwrap();
        assert_eq!(o.token.as_deref(), Some("T0ken"));
        let debug = format!("{o:?}");
        assert!(!debug.contains("T0ken") && debug.contains("***"), "{debug}");
        let o = parse_url("nats://app:S3cret@h:1").unwrap();
        assert!(!format!("{o:?}").contains("S3cret"));
        let seed = user_seed();
        let o = parse_url(&format!("nats://h:1?nkey_seed={seed}")).unwrap();
        assert_eq!(o.nkey_seed.as_deref(), Some(seed.as_str()));
        assert!(!format!("{o:?}").contains(&seed));
        let o = parse_url("nats://h:1?nkey_seed_file=/k/user.nk").unwrap();
        assert_eq!(o.nkey_seed_file.as_deref(), Some("/k/user.nk"));
        let o = parse_url("nats://h:1?creds=/k/user.creds").unwrap();
        assert_eq!(o.creds.as_deref(), Some("/k/user.creds"));

        let account_seed = nkeys::KeyPair::new_account().seed().unwrap();
        for (url, says) in [
            (
                "nats://app:S3cret@h:1?token=T0ken".to_string(),
                "more than once",
            ),
            (
                "nats://T0ken@h:1?creds=/u.creds".to_string(),
                "more than once",
            ),
            (
                format!("nats://h:1?nkey_seed={seed}&nkey_seed_file=/k"),
                "more than once",
            ),
            ("nats://h:1?user=app".to_string(), "password"),
            (
                "nats://h:1?password=S3cret&token=T0ken".to_string(),
                "password",
            ),
            ("nats://app:S3cret@h:1?user=bob".to_string(), "twice"),
            ("nats://app:S3cret@h:1?password=other".to_string(), "twice"),
            (
                "nats://T0ken@a:1,Other@b:2".to_string(),
                "different credentials",
            ),
            ("nats://app:@h:1".to_string(), "empty"),
            (
                "nats://h:1?nkey_seed=SUNOTASEED".to_string(),
                "not an NKey seed",
            ),
            (
                format!("nats://h:1?nkey_seed={account_seed}"),
                "not a user's",
            ),
            ("nats://h:1?password=".to_string(), "empty"),
            ("nats://h:1?passwd=S3cret".to_string(), "passwd"),
        ] {
            let e = parse_url(&url).unwrap_err();
            assert_eq!(e.kind(), onceflow_core::ErrorKind::Config, "{url}");
            assert!(e.message().contains(says), "{url}: {e}");
            let all = format!("{e} {e:?}");
            for secret in [
                "S3cret",
                "T0ken",
                "Other",
                seed.as_str(),
                account_seed.as_str(),
            ] {
                assert!(!all.contains(secret), "{url}: {all}");
            }
        }
        let e = parse_url("kafka://app:S3cret@h:1").unwrap_err();
        assert!(!e.message().contains("S3cret"), "{e}");
    }

    #[test]
    fn connection_keys_are_refused_among_consumer_options() {
        let mut o = JetStreamOptions::default();
        let mut m = BTreeMap::new();
        m.insert("ack_wait_ms".to_string(), "100".to_string());
        o.apply(&m).unwrap();
        m.insert("password".to_string(), "S3cret".to_string());
        let e = o.apply(&m).unwrap_err();
        assert!(e.message().contains("connection"), "{e}");
        assert!(!e.message().contains("S3cret"), "{e}");
    }

    #[test]
    fn idle_heartbeat_fits_in_the_pull_request() {
        let o = parse_url("nats://h:1?idle_heartbeat_ms=1000&pull_expires_ms=5000").unwrap();
        assert_eq!(o.idle_heartbeat, Some(Duration::from_millis(1000)));
        assert_eq!(o.pull_expires, Duration::from_millis(5000));
        assert_eq!(
            parse_url("nats://h:1?idle_heartbeat_ms=0")
                .unwrap()
                .idle_heartbeat,
            None
        );
        for (url, says) in [
            ("nats://h:1?idle_heartbeat_ms=300", "idle_heartbeat_ms=300"),
            ("nats://h:1?idle_heartbeat_ms=5", "at least 10 ms"),
            ("nats://h:1?idle_heartbeat_ms=x", "idle_heartbeat_ms=x"),
            ("nats://h:1?pull_expires_ms=50", "at least 100 ms"),
        ] {
            let e = parse_url(url).unwrap_err();
            assert_eq!(e.kind(), onceflow_core::ErrorKind::Config, "{url}");
            assert!(e.message().contains(says), "{url}: {e}");
        }
        let mut o = JetStreamOptions::default();
        let mut m = BTreeMap::new();
        m.insert("idle_heartbeat_ms".to_string(), "400".to_string());
        assert!(o
            .clone()
            .apply(&m)
            .unwrap_err()
            .message()
            .contains("pull_expires_ms=500"));
        m.insert("pull_expires_ms".to_string(), "1000".to_string());
        o.apply(&m).unwrap();
        assert!(
            parse_url("nats://h:1?reset=true&require_durable=true")
                .unwrap()
                .reset
        );
    }

    #[test]
    fn typed_options_are_checked_too() {
        let o = JetStreamOptions {
            servers: "nats://u:S3cret@h:1".into(),
            ..Default::default()
        };
        let e = o.validate().unwrap_err();
        assert!(!e.message().contains("S3cret"), "{e}");
        let o = JetStreamOptions {
            servers: "ws://h:1".into(),
            ..Default::default()
        };
        assert!(o.validate().is_err());
        let o = JetStreamOptions {
            tls_cert: Some("/c.pem".into()),
            ..Default::default()
        };
        assert!(o.validate().is_err());
        assert!(JetStreamOptions::default().validate().is_ok());
    }

    #[test]
    fn durations_refuse_zero_where_it_means_nothing_and_values_past_100_years() {
        for key in ["ack_wait_ms", "publish_timeout_ms", "request_timeout_ms"] {
            let e = parse_url(&format!("nats://h:1?{key}=0")).unwrap_err();
            assert!(
                e.message().contains(key) && e.message().contains("positive"),
                "{e}"
            );
        }
        for v in ["9223372036854775808", "1000000000000000"] {
            let e = parse_url(&format!("nats://h:1?ack_wait_ms={v}")).unwrap_err();
            assert!(e.message().contains("100 years"), "{e}");
        }
        assert!(parse_url("nats://h:1?ack_wait_ms=3153600000000").is_ok());
    }
}
