//! # onceflow-postgres
//!
//! A [`DedupStore`] on PostgreSQL shared by a fleet of consumers ([`PostgresStore`]), the lease
//! table with checkpoints the Kinesis consumer uses ([`PostgresCheckpointStore`]), and a
//! transactional [`Inbox`]: the idempotency key, the consumer's position and the handler's own
//! rows committed in one database transaction.
//!
//! ## The dedup store
//! - **Atomic on the server**: a claim is one statement that reads the keys' rows and takes the
//!   claimable ones with `INSERT … ON CONFLICT (key) DO UPDATE … WHERE <still claimable>`, in
//!   key order: the condition is checked again on the row's latest version under its row lock,
//!   so two claimers never both win a key (a key that changed between the read and the insert
//!   is sent again); keys that are not claimable (done, or held by another worker) are neither
//!   locked nor written. Renew, complete and release are single `UPDATE`s conditioned on the
//!   fencing token. Leases and expiry use the server's clock (`clock_timestamp()`), never the
//!   caller's.
//! - **Batched**: one statement handles a whole batch (`unnest` of arrays), one round trip per
//!   operation; a new key costs one row insert to claim and one update to complete, made in
//!   place (a HOT update: no index entries) when its page has room, which the table's
//!   `fillfactor = 50` leaves.
//! - **Fencing tokens** increase by one per claim of a key; a released key keeps its row (state
//!   0) until its window ends, so the next claim's token is higher.
//! - **Expiry**: rows are deleted once their window has passed, in chunks, by a purge that runs
//!   at most every `window / 2` (between 1 s and 5 min).
//! - **Durability** is PostgreSQL's: a completed key is committed before `complete` returns.
//!
//! ## Schema and migrations
//! Everything lives in one PostgreSQL schema (default `onceflow`, URL option `schema=`), created
//! on first use. The table `onceflow_schema_version(component, version)` records the version
//! (this build: [`SCHEMA_VERSION`]); opening takes a transaction-scoped advisory lock, applies
//! the missing migrations in order and records the new version, so concurrent first opens are
//! safe. A schema written by a newer onceflow is refused with an [`ErrorKind::DedupStore`]
//! error. Migration 1 creates:
//!
//! ```sql
//! CREATE TABLE dedup (
//!     key         text PRIMARY KEY,
//!     token       bigint NOT NULL,    -- fencing token of the last claim
//!     state       smallint NOT NULL,  -- 0 released, 1 in progress, 2 completed
//!     owner       text,               -- holder, while in progress
//!     lease_until bigint,             -- ms since the epoch (server clock), while in progress
//!     expires_at  bigint NOT NULL,    -- ms since the epoch: the row is forgotten after this
//!     fingerprint bytea,              -- 16 bytes, big-endian XXH3-128 of the payload
//!     result      bytea);
//! CREATE INDEX dedup_expires_at ON dedup (expires_at);
//! CREATE TABLE inbox_position (
//!     consumer_group text, topic text, partition integer,
//!     position text NOT NULL,         -- onceflow Position, as displayed (Position::from_str)
//!     updated_at timestamptz NOT NULL DEFAULT now(),
//!     PRIMARY KEY (consumer_group, topic, partition));
//! ```
//!
//! Migration 2 creates the lease table of [`PostgresCheckpointStore`] (see its module docs).
//! Migration 3 lets a completion update its row in place:
//!
//! ```sql
//! ALTER TABLE dedup ADD COLUMN done_until bigint;  -- ms since the epoch: end of a completed
//!                                                  -- key's dedup window (NULL: expires_at)
//! ALTER TABLE dedup SET (fillfactor = 50);
//! ```
//!
//! From version 3 on, `expires_at` is when the purge may delete the row, an upper bound of its
//! life that a completion leaves alone unless the lease had already run out; a completed key is
//! remembered until `COALESCE(done_until, expires_at)`. (PostgreSQL 15 can update a row in
//! place only if no indexed column changes; before, every completion wrote new entries in both
//! indexes.) An older onceflow refuses a version-3 schema as written by a newer one.
//!
//! ## URLs
//! `postgres://user:password@host:port/database[?schema=S&pool_size=N&op_timeout=SECONDS&sslmode=M&sslrootcert=PATH]`
//! (also `postgresql://`). `op_timeout` (default 30 s) bounds the wait for the server's answer
//! to each operation on an open connection (of the dedup store, the checkpoint store and the
//! inbox's own statements; the statements an inbox handler runs are its own to bound, e.g. with
//! `SET LOCAL statement_timeout`): past it the connection is closed and the operation
//! fails with a retriable [`ErrorKind::Timeout`], outcome unknown, logged at WARN with the
//! server's URL (password `***`). Other query options are passed to the PostgreSQL client
//! (`application_name`, `options`, `hostaddr`, `channel_binding`, …). `connect_timeout=SECONDS`
//! (default 5, at least 0.001) bounds the whole of a new connection (TCP, TLS,
//! authentication); 0 or less waits indefinitely, as in libpq.
//! Errors name the URL with its password replaced by `***`. PostgreSQL 12 or later: the store's
//! sessions plan every execution for its own arrays (`plan_cache_mode=force_custom_plan`, sent
//! at connection start; PostgreSQL's cached generic plans for these statements scan the whole
//! table).
//!
//! ## TLS and passwords (libpq's names and rules)
//! - **`sslmode`** ([libpq, table 34.1](https://www.postgresql.org/docs/current/libpq-ssl.html#LIBPQ-SSL-SSLMODE-STATEMENTS)),
//!   TLS by rustls (no system OpenSSL):
//!   `disable` (no TLS); `allow` and `prefer` (the default: TLS if the server offers it);
//!   `require` (TLS or fail); `verify-ca` (TLS, the server's certificate chain must lead to a
//!   trusted root); `verify-full` (that, and the certificate must name the URL's host: a DNS
//!   name or IP address in its subjectAltName). As in libpq, `prefer` and `require` check no
//!   certificate unless `sslrootcert` is given, and then check the chain as `verify-ca` does.
//!   With `hostaddr=IP` the connection goes to IP and the certificate is checked against the
//!   URL's host name.
//! - **`sslrootcert`**: a PEM file of trusted CA certificates, or `system` for the system's
//!   trusted roots; without it `~/.postgresql/root.crt` if that file exists. `verify-ca` and
//!   `verify-full` without any root are a [`ErrorKind::Config`] error.
//! - **`sslcert`** and **`sslkey`**: a client certificate (PEM chain) and its private key
//!   (PEM: PKCS#8, PKCS#1 or SEC1), both or neither, for servers that want one (`cert`
//!   authentication or `clientcert=verify-ca` in `pg_hba.conf`).
//! - **The password**: the URL's (`postgres://user:password@…` or `?password=`), else the
//!   `PGPASSWORD` environment variable, else the password file: `passfile=PATH`, else
//!   `PGPASSFILE`, else `~/.pgpass` ([libpq 34.16](https://www.postgresql.org/docs/current/libpq-pgpass.html)):
//!   lines `hostname:port:database:username:password`, the first whose four fields match the
//!   URL's host (a Unix socket counts as `localhost`), port (default 5432), database (default:
//!   the user) and user wins; a field of just `*` matches anything; `\` escapes `:` and `\`;
//!   `#` starts a comment line. A file that its group or others may read is ignored (with a
//!   warning), as libpq does. No other `PG*` variable is read.
//! - **Refusals** are [`ErrorKind::Auth`] errors, not retriable, within the connect timeout
//!   (5 s by default): a wrong password (SQLSTATE `28P01`), no `pg_hba.conf` line that lets
//!   the connection in (`28000`, e.g. a `hostssl`-only server and `sslmode=disable`), no
//!   password where the server asks for one, a server that does not accept TLS when the
//!   sslmode requires it, a server certificate that is not trusted or does not name the host,
//!   and a client certificate the server refuses. The message names the URL (password `***`),
//!   what was refused, where the password came from (the URL, `PGPASSWORD`, which password
//!   file and line: never the password) and the sslmode. A server that cannot be reached is a
//!   retriable [`ErrorKind::DedupStore`] error.

use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use onceflow_core::dedup::{
    ClaimOutcome, ClaimRequest, Completion, DedupStore, FencingToken, Fingerprint, KeyState,
};
use onceflow_core::{Error, ErrorKind, Result};
use tokio_postgres::error::SqlState;

mod checkpoint;
mod inbox;
mod tls;

pub use checkpoint::PostgresCheckpointStore;

pub use inbox::{Inbox, InboxConfig, InboxHandler, InboxPositions, InboxSummary};
/// The PostgreSQL client, re-exported for inbox handlers (their transaction is a
/// `tokio_postgres::Transaction`).
pub use tokio_postgres;

/// Schema version this build writes and reads.
pub const SCHEMA_VERSION: i32 = 3;

/// Default PostgreSQL schema of the store's tables.
pub const DEFAULT_SCHEMA: &str = "onceflow";

/// Default number of pooled connections.
pub const DEFAULT_POOL_SIZE: usize = 8;

/// Most expired rows one purge statement deletes.
const PURGE_CHUNK: i64 = 5_000;

/// Attempts of a statement that lost a deadlock or serialization race.
pub(crate) const MAX_TRIES: usize = 10;

pub use onceflow_core::redact_url;

/// Options of a [`PostgresStore`].
#[derive(Debug, Clone)]
pub struct PostgresOptions {
    /// How long a completed key is remembered (must be > 0).
    pub window: Duration,
    /// PostgreSQL schema of the tables (default [`DEFAULT_SCHEMA`]; URL option `schema=`).
    /// Letters, digits and `_`, starting with a letter or `_`, at most 63 characters.
    pub schema: String,
    /// Pooled connections (default [`DEFAULT_POOL_SIZE`]; URL option `pool_size=`).
    pub pool_size: usize,
    /// Longest wait for a new connection to be ready, from the TCP connect through TLS and
    /// authentication (default 5 s; URL option `connect_timeout=SECONDS`, a number: 0 or
    /// less, else at least 0.001). Zero waits indefinitely, as libpq's `connect_timeout=0`
    /// (and negative values) do; a non-zero value below 1 ms is 1 ms
    /// ([libpq connection parameters](https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-CONNECT-CONNECT-TIMEOUT)).
    /// Past it the operation that needed the connection fails with a retriable
    /// [`ErrorKind::Timeout`] naming the value; nothing was sent on that connection.
    pub connect_timeout: Duration,
    /// Longest wait for the server's answer to one operation of the store (a claim, renewal,
    /// completion, release, get or purge chunk) on an open connection (default
    /// [`DEFAULT_OP_TIMEOUT`]; URL option `op_timeout=SECONDS`, at least 0.001). Past it the
    /// connection is closed and the operation fails with a retriable [`ErrorKind::Timeout`]
    /// whose outcome is unknown (it may have been applied), logged at WARN: a network that
    /// goes silent does not stall the consumer for as long as the kernel keeps the socket.
    pub op_timeout: Duration,
}

/// The default [`PostgresOptions::op_timeout`]: 30 s.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(30);

impl PostgresOptions {
    /// Options with the given window and the defaults otherwise.
    pub fn new(window: Duration) -> Self {
        PostgresOptions {
            window,
            schema: DEFAULT_SCHEMA.to_string(),
            pool_size: DEFAULT_POOL_SIZE,
            connect_timeout: Duration::from_secs(5),
            op_timeout: DEFAULT_OP_TIMEOUT,
        }
    }
}

/// A pool of connections to one database, with the URL errors show.
#[derive(Clone)]
pub(crate) struct Db {
    pub(crate) pool: Pool,
    pub(crate) shown: Arc<str>,
    /// Quoted schema name, for SQL.
    pub(crate) schema: Arc<str>,
    /// Where the password came from and the sslmode, for the errors of a refused connection
    /// (never the password).
    pub(crate) login: Arc<str>,
    /// [`PostgresOptions::op_timeout`].
    pub(crate) op_timeout: Duration,
    /// The connect timeout in effect (`None`: wait indefinitely), for errors.
    pub(crate) connect_timeout: Option<Duration>,
}

/// A query run on a pooled connection, borrowing it (what `timed` and `with_retry` run).
type PgFuture<'c, T> = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>> + Send + 'c,
    >,
>;

impl Db {
    pub(crate) fn error(&self, what: &str, e: tokio_postgres::Error) -> Error {
        pg_error(&self.shown, what, e)
    }

    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object> {
        self.pool
            .get()
            .await
            .map_err(|e| pool_error(&self.shown, &self.login, self.connect_timeout, e))
    }

    /// Runs `f` on `client` within the operation timeout. Past it, closes the connection
    /// (taken out of the pool: its answer may still come, or never), logs a WARN line naming
    /// the server and returns a retriable [`ErrorKind::Timeout`] with outcome unknown.
    pub(crate) async fn timed<T, F>(
        &self,
        what: &str,
        client: deadpool_postgres::Object,
        f: F,
    ) -> Result<(
        deadpool_postgres::Object,
        std::result::Result<T, tokio_postgres::Error>,
    )>
    where
        F: for<'c> FnOnce(&'c mut deadpool_postgres::Object) -> PgFuture<'c, T>,
    {
        let mut client = client;
        match self.within(f(&mut client)).await {
            Some(r) => Ok((client, r)),
            None => Err(self.timed_out(what, client)),
        }
    }

    /// `op`'s answer within the operation timeout, `None` past it (then give the connection
    /// `op` used to [`Db::timed_out`]).
    pub(crate) async fn within<T>(&self, op: impl std::future::Future<Output = T>) -> Option<T> {
        tokio::time::timeout(self.op_timeout, op).await.ok()
    }

    /// The end of an operation that had no answer within the operation timeout: closes its
    /// connection (taken out of the pool: its answer may still come, or never), logs a WARN
    /// line naming the server, and returns a retriable [`ErrorKind::Timeout`] with outcome
    /// unknown.
    pub(crate) fn timed_out(&self, what: &str, client: deadpool_postgres::Object) -> Error {
        drop(deadpool_postgres::Object::take(client));
        tracing::warn!(
            server = %self.shown,
            operation = what,
            op_timeout = ?self.op_timeout,
            "PostgreSQL store: no answer within op_timeout; connection closed"
        );
        let msg = format!(
            "PostgreSQL store '{}': {what}: no answer from the server within op_timeout={} s \
             (the network or the server may be down); the operation may or may not have been \
             applied",
            self.shown,
            self.op_timeout.as_secs_f64()
        );
        Error::new(ErrorKind::Timeout, msg)
            .with_outcome_unknown()
            .retriable(true)
    }

    /// `schema.table`.
    pub(crate) fn t(&self, table: &str) -> String {
        format!("{}.{table}", self.schema)
    }
}

/// Maps a PostgreSQL error, naming the (redacted) URL.
pub(crate) fn pg_error(shown: &str, what: &str, e: tokio_postgres::Error) -> Error {
    login_error(shown, "", what, e)
}

/// [`pg_error`], adding `login` (where the password came from, the sslmode) to an
/// [`ErrorKind::Auth`] error.
fn login_error(shown: &str, login: &str, what: &str, e: tokio_postgres::Error) -> Error {
    let login = if login.is_empty() {
        String::new()
    } else {
        format!(" ({login})")
    };
    if let Some(tls) = tls::tls_failure(&e) {
        return Error::new(
            ErrorKind::Auth,
            format!("PostgreSQL store '{shown}': {what}: {tls}{login}"),
        )
        .with_source(e);
    }
    // tokio-postgres's own words for these two refusals (no error code to match), in the
    // error's causes (its Display is only "invalid configuration", "error performing TLS
    // handshake").
    let text = with_causes(&e);
    if e.as_db_error().is_none() {
        let refused = if text.contains("server does not support TLS") {
            Some("the server does not accept TLS connections (sslmode requires TLS)")
        } else if text.contains("password missing") {
            Some("the server asks for a password and none was given")
        } else {
            None
        };
        if let Some(r) = refused {
            return Error::new(
                ErrorKind::Auth,
                format!("PostgreSQL store '{shown}': {what}: {r}: {text}{login}"),
            )
            .with_source(e);
        }
    }
    let detail = match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => text,
    };
    let msg = format!("PostgreSQL store '{shown}': {what}: {detail}");
    let code = e.code().cloned();
    let retriable = e.is_closed()
        || e.as_db_error().is_none()
        || matches!(
            code,
            Some(
                SqlState::T_R_DEADLOCK_DETECTED
                    | SqlState::T_R_SERIALIZATION_FAILURE
                    | SqlState::ADMIN_SHUTDOWN
                    | SqlState::CRASH_SHUTDOWN
                    | SqlState::CANNOT_CONNECT_NOW
            )
        );
    // 28P01 a wrong password, 28000 no pg_hba.conf line lets us in (e.g. hostssl only and
    // no TLS, or a role that may not log in).
    let auth = matches!(
        code,
        Some(SqlState::INVALID_PASSWORD | SqlState::INVALID_AUTHORIZATION_SPECIFICATION)
    );
    if auth {
        return Error::new(ErrorKind::Auth, format!("{msg}{login}")).with_source(e);
    }
    Error::dedup_store(msg).retriable(retriable).with_source(e)
}

/// `e` and its causes, `: `-separated.
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let s = c.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        cur = c.source();
    }
    text
}

fn pool_error(
    shown: &str,
    login: &str,
    connect_timeout: Option<Duration>,
    e: deadpool_postgres::PoolError,
) -> Error {
    match e {
        deadpool_postgres::PoolError::Backend(e) => login_error(shown, login, "cannot connect", e),
        // deadpool's own words ("Timeout occurred while creating a new object") name none of
        // the store's settings.
        // A timeout (retriable): nothing was sent on the new connection, so the operation
        // was not applied.
        deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Create) => {
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "PostgreSQL store '{shown}': cannot connect: the server did not complete a \
                     new connection within the connect timeout of {} s (URL option \
                     connect_timeout=SECONDS, default 5): it is down, the address is wrong, \
                     or the network is silent",
                    connect_timeout.map_or(0.0, |d| d.as_secs_f64())
                ),
            )
            .retriable(true)
        }
        deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Wait) => {
            Error::dedup_store(format!(
                "PostgreSQL store '{shown}': every pooled connection stayed busy for 60 s: \
                 raise pool_size= in the URL, or the server is slow to answer"
            ))
            .retriable(true)
        }
        other => Error::dedup_store(format!(
            "PostgreSQL store '{shown}': cannot get a connection: {other}"
        ))
        .retriable(true),
    }
}

pub(crate) fn is_race(e: &tokio_postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(&SqlState::T_R_DEADLOCK_DETECTED | &SqlState::T_R_SERIALIZATION_FAILURE)
    )
}

/// The session settings of the store's connections, before those of the URL's `options=` (so
/// the URL can override them).
///
/// `plan_cache_mode=force_custom_plan` (PostgreSQL 12 and later): the store's statements are
/// prepared once per connection and take arrays whose length changes from call to call.
/// PostgreSQL's generic plan for them, chosen after five executions, is costed for 10-element
/// arrays against the table as it was then (often empty, on a new schema) and then scans the
/// whole table on every call, however large it has grown: a batch of 100 completions took 5×
/// longer on a table of 20 000 keys. Each execution is planned for its own arrays instead
/// (a fraction of a millisecond).
fn session_options(url_options: Option<&str>) -> String {
    const OURS: &str = "-c plan_cache_mode=force_custom_plan";
    match url_options.map(str::trim) {
        Some(o) if !o.is_empty() => format!("{OURS} {o}"),
        _ => OURS.to_string(),
    }
}

/// Parses the URL, takes out onceflow's options, builds the pool, creates or checks the schema.
pub(crate) async fn connect(url: &str, options: &PostgresOptions) -> Result<Db> {
    // `redact_url`, not `redact_credentials`: a user name without a password is no secret in a
    // PostgreSQL URL, and errors name it (`postgres://onceflow@host/db`).
    let shown = redact_url(url.trim());
    let mut parsed = url::Url::parse(url.trim()).map_err(|e| {
        Error::config(format!(
            "PostgreSQL store URL '{shown}' is not a URL ({e}): expected \
             postgres://user:password@host:port/database[?schema=S&pool_size=N]"
        ))
    })?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(Error::config(format!(
            "PostgreSQL store URL '{shown}' has scheme '{}': expected postgres:// or postgresql://",
            parsed.scheme()
        )));
    }
    let mut schema = options.schema.clone();
    let mut pool_size = options.pool_size;
    let mut op_timeout = options.op_timeout;
    let mut connect_timeout = options.connect_timeout;
    let mut rest = Vec::new();
    let mut pairs: Vec<(String, String)> = parsed.query_pairs().into_owned().collect();
    let tls_options = tls::Options::take(&mut pairs);
    for (k, v) in pairs {
        match &*k {
            "schema" => schema = v,
            "op_timeout" => {
                op_timeout = v
                    .parse::<f64>()
                    .ok()
                    .filter(|n| n.is_finite() && *n > 0.0)
                    .and_then(|n| Duration::try_from_secs_f64(n).ok())
                    // At least 1 ms: a smaller value rounds to nothing, and every operation
                    // would time out at once, for ever (#28).
                    .filter(|d| *d >= Duration::from_millis(1))
                    .ok_or_else(|| {
                        Error::config(format!(
                            "op_timeout '{v}' in '{shown}' is not a number of seconds of at \
                             least 0.001"
                        ))
                    })?
            }
            // Taken here, not by the PostgreSQL client: it reads whole seconds only, turns 0
            // and negative values into "no timeout" that the pool's own create timeout then
            // overrode, and its error names neither the option nor the value (#28).
            "connect_timeout" => {
                let t = v.trim();
                // Written as more than 0 (a nonzero digit before any exponent, no minus): a
                // value that underflows to 0.0 (`1e-400`) is still a positive one.
                let positive = !t.starts_with('-')
                    && t.split(['e', 'E'])
                        .next()
                        .is_some_and(|m| m.bytes().any(|b| (b'1'..=b'9').contains(&b)));
                connect_timeout = t
                    .parse::<f64>()
                    .ok()
                    // A positive value below 1 ms would round to nothing, which reads as "wait
                    // indefinitely": the opposite of the short bound asked for (#28).
                    .filter(|n| n.is_finite() && if positive { *n >= 0.001 } else { *n <= 0.0 })
                    // Past `Duration`'s range (1e300) it is refused, not "wait indefinitely".
                    .and_then(|n| Duration::try_from_secs_f64(n.max(0.0)).ok())
                    .ok_or_else(|| {
                        Error::config(format!(
                            "connect_timeout '{v}' in '{shown}' is not a number of seconds: \
                             expected e.g. connect_timeout=5, at least 0.001 (0 or less waits \
                             indefinitely, as libpq)"
                        ))
                    })?
            }
            "pool_size" => {
                pool_size = v.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    Error::config(format!(
                        "pool_size '{v}' in '{shown}' is not a positive whole number"
                    ))
                })?
            }
            _ => rest.push((k, v)),
        }
    }
    let valid = !schema.is_empty()
        && schema.len() <= 63
        && schema
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !schema.starts_with(|c: char| c.is_ascii_digit());
    if !valid {
        return Err(Error::config(format!(
            "schema '{schema}' for '{shown}' is not a plain identifier: expected letters, \
             digits and '_', starting with a letter or '_', at most 63 characters"
        )));
    }
    if rest.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(rest);
    }
    let mut config: tokio_postgres::Config = parsed
        .as_str()
        .parse()
        .map_err(|e| client_refused(&parsed, &shown, e))?;
    // Zero waits indefinitely (libpq); a non-zero value below 1 ms (only through
    // `PostgresOptions`: the URL's is refused above) is 1 ms, not "indefinitely" (#28).
    let connect_timeout =
        (!connect_timeout.is_zero()).then(|| connect_timeout.max(Duration::from_millis(1)));
    if let Some(timeout) = connect_timeout {
        config.connect_timeout(timeout);
    }
    if config.get_application_name().is_none() {
        config.application_name("onceflow");
    }
    config.options(session_options(config.get_options()));
    let security = tls::security(&tls_options, &shown)?;
    config.ssl_mode(tls::ssl_mode(security.mode));
    let password_from = tls::resolve_password(&mut config, tls_options.passfile.as_deref());
    let login = format!("{password_from}; sslmode={}", security.mode.name());
    let manager = Manager::from_config(
        config,
        security.connector,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(pool_size)
        .runtime(Runtime::Tokio1)
        // The client's own connect timeout covers the TCP connect only; this one covers the
        // whole of a new connection (TLS, authentication, session start), so the bound is the
        // value asked for (it was 250 ms later: `connect_timeout=0.001` took 0.27 s while the
        // error said 0.001 s).
        .create_timeout(connect_timeout)
        .wait_timeout(Some(Duration::from_secs(60)))
        .build()
        .map_err(|e| {
            Error::config(format!(
                "PostgreSQL store '{shown}': cannot build the pool: {e}"
            ))
        })?;
    let db = Db {
        pool,
        shown: shown.into(),
        schema: format!("\"{schema}\"").into(),
        login: login.into(),
        op_timeout,
        connect_timeout,
    };
    migrate(&db).await?;
    Ok(db)
}

/// The error for a URL the PostgreSQL client refuses: names the first query option it refuses
/// alone (with its value, never a password's), else the client's words.
fn client_refused(parsed: &url::Url, shown: &str, e: tokio_postgres::Error) -> Error {
    let mut bare = parsed.clone();
    bare.set_query(None);
    let refused = parsed.query_pairs().find(|(k, v)| {
        let mut one = bare.clone();
        one.query_pairs_mut().append_pair(k, v);
        one.as_str().parse::<tokio_postgres::Config>().is_err()
    });
    match refused {
        Some((k, _)) => {
            // The value as the redacted URL shows it: secret keys' values are `***`, URLs
            // inside values lose their user info.
            let v = url::Url::parse(shown)
                .ok()
                .and_then(|u| {
                    u.query_pairs()
                        .find(|(key, _)| *key == k)
                        .map(|(_, v)| v.into_owned())
                })
                .unwrap_or_else(|| "***".into());
            Error::config(format!(
                "PostgreSQL store URL '{shown}': option {k}='{v}' is refused by the PostgreSQL \
                 client ({e}): see libpq's connection parameters for the values it takes"
            ))
        }
        None => Error::config(format!(
            "PostgreSQL store URL '{shown}' is not valid for the PostgreSQL client: {e}"
        )),
    }
}

/// Migrations, in order; migration `i` brings the schema to version `i + 1`.
fn migrations(s: &str) -> Vec<String> {
    vec![
        format!(
            "CREATE TABLE {s}.dedup (
            key         text PRIMARY KEY,
            token       bigint NOT NULL,
            state       smallint NOT NULL,
            owner       text,
            lease_until bigint,
            expires_at  bigint NOT NULL,
            fingerprint bytea,
            result      bytea);
         CREATE INDEX dedup_expires_at ON {s}.dedup (expires_at);
         CREATE TABLE {s}.inbox_position (
            consumer_group text NOT NULL,
            topic          text NOT NULL,
            partition      integer NOT NULL,
            position       text NOT NULL,
            updated_at     timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (consumer_group, topic, partition));"
        ),
        format!(
            "CREATE TABLE {s}.lease (
            grp         text NOT NULL,
            key         text NOT NULL,
            owner       text,
            counter     bigint NOT NULL,
            lease_until bigint NOT NULL,
            checkpoint  text,
            parents     text[] NOT NULL,
            PRIMARY KEY (grp, key));"
        ),
        // A completion no longer changes an indexed column (it writes `done_until`, and
        // `expires_at` only grows when the lease had run out), so with room left on each page
        // PostgreSQL updates the row in place (a HOT update: no new entries in the primary key
        // and `expires_at` indexes). Existing pages keep their fill; new pages leave half free.
        format!(
            "ALTER TABLE {s}.dedup ADD COLUMN done_until bigint;
         ALTER TABLE {s}.dedup SET (fillfactor = 50);"
        ),
    ]
}

async fn migrate(db: &Db) -> Result<()> {
    let mut client = db.client().await?;
    let s = &db.schema;
    let tx = client
        .transaction()
        .await
        .map_err(|e| db.error("cannot begin", e))?;
    // One migrating session at a time, across processes (key: "onceflow" in ASCII).
    tx.batch_execute(&format!(
        "SELECT pg_advisory_xact_lock(7957695013313466999);
         CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.onceflow_schema_version (
             component text PRIMARY KEY,
             version   integer NOT NULL);"
    ))
    .await
    .map_err(|e| db.error("cannot create the schema", e))?;
    let found: Option<i32> = tx
        .query_opt(
            &format!(
                "SELECT version FROM {s}.onceflow_schema_version WHERE component = 'onceflow'"
            ),
            &[],
        )
        .await
        .map_err(|e| db.error("cannot read the schema version", e))?
        .map(|r| r.get(0));
    let current = found.unwrap_or(0);
    if current > SCHEMA_VERSION {
        return Err(Error::dedup_store(format!(
            "PostgreSQL store '{}': schema {s} has version {current}, written by a newer \
             onceflow; this build reads schema version {SCHEMA_VERSION} at most (upgrade \
             onceflow or use another schema with ?schema=NAME)",
            db.shown
        )));
    }
    for (i, sql) in migrations(s).iter().enumerate() {
        let version = i as i32 + 1;
        if version > current {
            tx.batch_execute(sql)
                .await
                .map_err(|e| db.error(&format!("migration to version {version} failed"), e))?;
        }
    }
    if current < SCHEMA_VERSION {
        tx.execute(
            &format!(
                "INSERT INTO {s}.onceflow_schema_version (component, version) VALUES ('onceflow', $1)
                 ON CONFLICT (component) DO UPDATE SET version = excluded.version"
            ),
            &[&SCHEMA_VERSION],
        )
        .await
        .map_err(|e| db.error("cannot record the schema version", e))?;
    }
    tx.commit()
        .await
        .map_err(|e| db.error("cannot commit the schema", e))
}

/// A dedup store on PostgreSQL. Cheap to clone (clones share the pool).
#[derive(Clone)]
pub struct PostgresStore {
    db: Db,
    window: Duration,
    sql: Arc<Sql>,
    _purger: Arc<PurgeGuard>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("url", &self.db.shown)
            .field("schema", &self.db.schema)
            .field("window", &self.window)
            .finish()
    }
}

/// Stops the purge task when the last clone of the store is dropped.
struct PurgeGuard(tokio::task::JoinHandle<()>);

impl Drop for PurgeGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The store's statements, for its schema.
struct Sql {
    claim: String,
    renew: String,
    complete: String,
    release: String,
    get: String,
    purge: String,
}

pub(crate) const NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

impl Sql {
    fn new(s: &str) -> Sql {
        let d = format!("{s}.dedup");
        Sql {
            // One statement, one round trip: read every key's row (no lock), insert or take
            // over those that are claimable in that read (`INSERT … ON CONFLICT DO UPDATE`, in
            // key order, re-checking the row it conflicts with under its lock), and return
            // both. A key claimable in the read but not taken raced with another writer: the
            // caller sends it again. Keys that are not claimable are neither locked nor written.
            // The reads are `LATERAL … LIMIT 1`: one primary-key lookup per key, whatever the
            // planner thinks of the table (left to itself it hashes a scan of the whole table,
            // 7x slower for 1000 keys among 50 000).
            claim: format!(
                "WITH u AS (SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], \
                 $4::bytea[]) WITH ORDINALITY AS u(key, owner, lease, fp, ord)), \
                 n AS (SELECT {NOW_MS} AS ms), \
                 cur AS (SELECT u.ord, u.key, u.owner AS req_owner, u.lease, u.fp AS req_fp, \
                 n.ms, d.token, d.state, d.owner, d.lease_until, d.fingerprint, d.result, \
                 (d.key IS NULL OR NOT ({live_d}) OR ({holder_d})) AS claimable \
                 FROM u CROSS JOIN n LEFT JOIN LATERAL \
                 (SELECT * FROM {d} AS x WHERE x.key = u.key LIMIT 1) AS d ON true), \
                 ins AS (INSERT INTO {d} AS t \
                 (key, token, state, owner, lease_until, expires_at, fingerprint, result) \
                 SELECT key, 1, 1, req_owner, ms + lease, ms + lease + $5, req_fp, NULL \
                 FROM cur WHERE claimable ORDER BY key \
                 ON CONFLICT (key) DO UPDATE SET token = t.token + 1, state = 1, \
                 owner = excluded.owner, lease_until = excluded.lease_until, \
                 expires_at = excluded.expires_at, done_until = NULL, \
                 fingerprint = CASE WHEN {live_t} THEN \
                 COALESCE(t.fingerprint, excluded.fingerprint) ELSE excluded.fingerprint END, \
                 result = NULL \
                 WHERE NOT ({live_t}) OR ({holder_t}) \
                 RETURNING t.key, t.token) \
                 SELECT c.ord, i.token, c.claimable, c.state, c.owner, c.lease_until, \
                 c.fingerprint, c.result, c.ms \
                 FROM cur AS c LEFT JOIN ins AS i ON i.key = c.key",
                live_d = "(d.state = 2 AND COALESCE(d.done_until, d.expires_at) > n.ms) \
                 OR (d.state = 1 AND d.lease_until > n.ms)",
                holder_d = "d.state = 1 AND d.owner = u.owner AND (d.fingerprint IS NULL \
                 OR u.fp IS NULL OR d.fingerprint = u.fp)",
                live_t = format!(
                    "(t.state = 2 AND COALESCE(t.done_until, t.expires_at) > {NOW_MS}) \
                 OR (t.state = 1 AND t.lease_until > {NOW_MS})"
                ),
                holder_t = "t.state = 1 AND t.owner = excluded.owner AND (t.fingerprint IS NULL \
                 OR excluded.fingerprint IS NULL OR t.fingerprint = excluded.fingerprint)",
            ),
            renew: format!(
                "WITH u AS (SELECT * FROM unnest($1::text[], $2::bigint[]) AS u(key, token)), \
                 n AS (SELECT {NOW_MS} AS ms) \
                 UPDATE {d} AS d SET lease_until = n.ms + $3, expires_at = n.ms + $3 + $4 \
                 FROM u, n WHERE d.key = u.key AND d.token = u.token AND d.state = 1 \
                 RETURNING d.key, d.token"
            ),
            complete: format!(
                "WITH u AS (SELECT * FROM unnest($1::text[], $2::bigint[], $3::bytea[]) \
                 AS u(key, token, result)), n AS (SELECT {NOW_MS} AS ms), \
                 upd AS (UPDATE {d} AS d SET state = 2, owner = NULL, lease_until = NULL, \
                 expires_at = GREATEST(d.expires_at, n.ms + $4), done_until = n.ms + $4, \
                 result = u.result FROM u, n \
                 WHERE d.key = u.key AND d.token = u.token AND d.state = 1 \
                 RETURNING d.key, d.token), \
                 rest AS MATERIALIZED (SELECT u.key, u.token FROM u \
                 LEFT JOIN upd ON upd.key = u.key WHERE upd.key IS NULL), \
                 prev AS (SELECT d.key, d.token FROM rest \
                 CROSS JOIN LATERAL (SELECT key, token, state, \
                 COALESCE(done_until, expires_at) AS until FROM {d} AS x \
                 WHERE x.key = rest.key AND x.token = rest.token LIMIT 1) AS d, n \
                 WHERE d.state = 2 AND d.until > n.ms) \
                 SELECT key, token FROM upd UNION ALL SELECT key, token FROM prev"
            ),
            release: format!(
                "WITH u AS (SELECT * FROM unnest($1::text[], $2::bigint[]) AS u(key, token)) \
                 UPDATE {d} AS d SET state = 0, owner = NULL, lease_until = NULL, \
                 fingerprint = NULL, result = NULL \
                 FROM u WHERE d.key = u.key AND d.token = u.token AND d.state = 1 \
                 RETURNING d.key, d.token"
            ),
            get: format!(
                "SELECT key, token, state, owner, lease_until, \
                 COALESCE(done_until, expires_at), fingerprint, result, \
                 {NOW_MS} FROM {d} WHERE key = ANY($1::text[])"
            ),
            purge: format!(
                "DELETE FROM {d} WHERE key IN (SELECT key FROM {d} \
                 WHERE expires_at <= {NOW_MS} LIMIT {PURGE_CHUNK})"
            ),
        }
    }
}

/// A row of the dedup table.
#[derive(Debug, Clone)]
struct Row {
    token: i64,
    state: i16,
    owner: Option<String>,
    lease_until: Option<i64>,
    expires_at: i64,
    fingerprint: Option<Vec<u8>>,
    result: Option<Vec<u8>>,
}

impl Row {
    fn from_pg(r: &tokio_postgres::Row) -> (String, Row, i64) {
        (
            r.get(0),
            Row {
                token: r.get(1),
                state: r.get(2),
                owner: r.get(3),
                lease_until: r.get(4),
                expires_at: r.get(5),
                fingerprint: r.get(6),
                result: r.get(7),
            },
            r.get(8),
        )
    }
}

fn fp_of(b: &Option<Vec<u8>>) -> Option<Fingerprint> {
    b.as_deref()
        .and_then(|b| Some(Fingerprint::from_be_bytes(b.try_into().ok()?)))
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

fn sql_token(t: FencingToken) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}

impl PostgresStore {
    /// Connects to the database at `url` (`postgres://user:password@host:port/database`,
    /// optional `?schema=S&pool_size=N`), creating or checking the schema, remembering
    /// completed keys for `window`.
    ///
    /// TLS and the password follow libpq (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`,
    /// `PGPASSWORD`, `~/.pgpass`): see the [crate docs](crate#tls-and-passwords-libpqs-names-and-rules).
    ///
    /// Errors: [`ErrorKind::Config`] for a malformed URL, a bad option, a certificate file that
    /// cannot be read or a zero window; [`ErrorKind::Auth`] when the server refuses the
    /// password or a TLS certificate (its own or ours), or lets no such connection in;
    /// [`ErrorKind::DedupStore`] when the database cannot be reached or holds a schema from a
    /// newer onceflow. Every message names the URL without its password.
    pub async fn open(url: &str, window: Duration) -> Result<Self> {
        Self::open_with(url, PostgresOptions::new(window)).await
    }

    /// Connects with `options`; `schema=` and `pool_size=` in the URL override them.
    pub async fn open_with(url: &str, options: PostgresOptions) -> Result<Self> {
        if options.window.is_zero() {
            return Err(Error::config(format!(
                "dedup window for '{}' is 0: expected a positive duration",
                redact_url(url)
            )));
        }
        let db = connect(url, &options).await?;
        let sql = Arc::new(Sql::new(&db.schema));
        let interval = (options.window / 2).clamp(Duration::from_secs(1), Duration::from_secs(300));
        let purger = tokio::spawn(purge_loop(Arc::downgrade(&sql), db.clone(), interval));
        Ok(PostgresStore {
            db,
            window: options.window,
            sql,
            _purger: Arc::new(PurgeGuard(purger)),
        })
    }

    /// The URL with its password replaced by `***`.
    pub fn url(&self) -> &str {
        &self.db.shown
    }

    /// The connection pool (for queries of the application's own).
    pub fn pool(&self) -> &Pool {
        &self.db.pool
    }

    /// The quoted PostgreSQL schema holding the store's tables.
    pub fn schema(&self) -> &str {
        &self.db.schema
    }

    /// A transactional inbox over `consumer` that keeps its keys and positions in this store's
    /// database (see [`Inbox`]).
    pub fn inbox(&self, consumer: onceflow_core::Consumer, config: InboxConfig) -> Inbox {
        Inbox::new(self.db.clone(), self.window, consumer, config)
    }

    /// The statements of a claim and of a completion, for benchmarks that run the same
    /// commands through the bare PostgreSQL client. Claim: `$1` keys (`text[]`), `$2` owners
    /// (`text[]`), `$3` leases in ms (`bigint[]`), `$4` fingerprints (`bytea[]`), `$5` the
    /// window in ms; one row per key: ordinality, token if claimed, claimable when read, then
    /// the row as read (state, owner, lease end, fingerprint, result) and the server's time in
    /// ms. Completion: `$1` keys, `$2` tokens, `$3` results, `$4` the window in ms; one row per
    /// completed (key, token).
    #[doc(hidden)]
    pub fn bench_statements(&self) -> [&str; 2] {
        [&self.sql.claim, &self.sql.complete]
    }

    /// Deletes every expired row now (the store also does this by itself). Returns the number
    /// of rows deleted.
    pub async fn purge_expired(&self) -> Result<u64> {
        purge_all(&self.db, &self.sql.purge).await
    }

    /// Runs the claim statement for `round` (indexes into `requests`, one per key), writes the
    /// decided outcomes into `out` and returns the requests that raced with another writer.
    async fn claim_round(
        &self,
        requests: &[ClaimRequest],
        round: &[usize],
        out: &mut [Option<ClaimOutcome>],
    ) -> Result<Vec<usize>> {
        let mut order: Vec<usize> = round.to_vec();
        order.sort_unstable_by(|a, b| requests[*a].key.cmp(&requests[*b].key));
        let keys: Vec<String> = order.iter().map(|i| requests[*i].key.clone()).collect();
        let owners: Vec<String> = order.iter().map(|i| requests[*i].owner.clone()).collect();
        let leases: Vec<i64> = order.iter().map(|i| ms(requests[*i].lease)).collect();
        let fps: Vec<Option<Vec<u8>>> = order
            .iter()
            .map(|i| requests[*i].fingerprint.map(|f| f.to_be_bytes().to_vec()))
            .collect();
        let window = ms(self.window);
        let sql = self.sql.clone();
        let rows = self
            .with_retry("claim failed", move |client| {
                let (sql, keys, owners, leases, fps) = (
                    sql.clone(),
                    keys.clone(),
                    owners.clone(),
                    leases.clone(),
                    fps.clone(),
                );
                Box::pin(async move {
                    let st = client.prepare_cached(&sql.claim).await?;
                    client
                        .query(&st, &[&keys, &owners, &leases, &fps, &window])
                        .await
                })
            })
            .await?;
        if rows.len() != order.len() {
            return Err(Error::dedup_store(format!(
                "PostgreSQL store '{}': {} rows answered a claim of {} keys",
                self.db.shown,
                rows.len(),
                order.len()
            )));
        }
        let mut raced = Vec::new();
        for r in &rows {
            let ord: i64 = r.get(0);
            let Some(&i) = usize::try_from(ord - 1).ok().and_then(|o| order.get(o)) else {
                return Err(Error::dedup_store(format!(
                    "PostgreSQL store '{}': claim answered for key number {ord} of {}",
                    self.db.shown,
                    order.len()
                )));
            };
            let req = &requests[i];
            let claimed: Option<i64> = r.get(1);
            let claimable: bool = r.get(2);
            out[i] = Some(match claimed {
                Some(token) => ClaimOutcome::Claimed {
                    token: u64::try_from(token).unwrap_or(0),
                },
                None if claimable => {
                    raced.push(i);
                    continue;
                }
                // Read live and not the caller's: decided by the row as read.
                None => {
                    let state: Option<i16> = r.get(3);
                    let now: i64 = r.get(8);
                    let stored = fp_of(&r.get(6));
                    match (stored, req.fingerprint) {
                        (Some(stored), Some(given)) if stored != given => {
                            ClaimOutcome::Mismatch { stored, given }
                        }
                        _ if state == Some(2) => ClaimOutcome::Duplicate {
                            result: r.get::<_, Option<Vec<u8>>>(7).map(Bytes::from),
                        },
                        _ => ClaimOutcome::InProgress {
                            owner: r.get::<_, Option<String>>(4).unwrap_or_default(),
                            expires_in: Duration::from_millis(
                                u64::try_from(r.get::<_, Option<i64>>(5).unwrap_or(now) - now)
                                    .unwrap_or(0),
                            ),
                        },
                    }
                }
            });
        }
        Ok(raced)
    }

    /// Runs `f` with a pooled connection, retrying when it loses a deadlock or serialization
    /// race (never for other errors).
    async fn with_retry<T, F>(&self, what: &str, f: F) -> Result<T>
    where
        F: for<'c> Fn(&'c mut deadpool_postgres::Object) -> PgFuture<'c, T>,
    {
        let mut client = self.db.client().await?;
        let mut tries = 0;
        loop {
            tries += 1;
            let (back, r) = self.db.timed(what, client, &f).await?;
            client = back;
            match r {
                Ok(v) => return Ok(v),
                Err(e) if is_race(&e) && tries < MAX_TRIES => {
                    tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 20)).await;
                }
                Err(e) => return Err(self.db.error(what, e)),
            }
        }
    }
}

async fn purge_all(db: &Db, sql: &str) -> Result<u64> {
    let mut client = db.client().await?;
    let mut total = 0;
    loop {
        let (back, n) = db
            .timed("purge failed", client, |client| {
                let sql = sql.to_string();
                Box::pin(async move { client.execute(&sql, &[]).await })
            })
            .await?;
        client = back;
        let n = n.map_err(|e| db.error("purge failed", e))?;
        total += n;
        if n < PURGE_CHUNK as u64 {
            return Ok(total);
        }
    }
}

async fn purge_loop(sql: Weak<Sql>, db: Db, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        let Some(sql) = sql.upgrade() else { return };
        if let Err(e) = purge_all(&db, &sql.purge).await {
            tracing::warn!(error = %e, "dedup purge");
        }
    }
}

#[async_trait]
impl DedupStore for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn window(&self) -> Duration {
        self.window
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>> {
        onceflow_core::dedup::check_claims(requests)?;
        let mut out: Vec<Option<ClaimOutcome>> = vec![None; requests.len()];
        // Requests still to decide, in batch order. Each statement takes the first request of
        // each key among them, so a key asked for twice in one batch is decided in order (the
        // second sees the first's claim), as if the requests came one after the other.
        let mut pending: Vec<usize> = (0..requests.len()).collect();
        let mut races = 0;
        while !pending.is_empty() {
            let mut seen = std::collections::HashSet::new();
            let (round, rest): (Vec<usize>, Vec<usize>) = pending
                .iter()
                .partition(|i| seen.insert(requests[**i].key.as_str()));
            let raced = self.claim_round(requests, &round, &mut out).await?;
            if !raced.is_empty() {
                races += 1;
                if races >= MAX_TRIES {
                    return Err(Error::dedup_store(format!(
                        "PostgreSQL store '{}': claim raced with other writers {races} times \
                         in a row on {} key(s)",
                        self.db.shown,
                        raced.len()
                    ))
                    .retriable(true));
                }
            }
            pending = raced;
            pending.extend(rest);
            pending.sort_unstable();
        }
        Ok(out
            .into_iter()
            .map(|o| o.expect("every claim decided"))
            .collect())
    }

    async fn renew(&self, claims: &[(String, FencingToken)], lease: Duration) -> Result<Vec<bool>> {
        onceflow_core::dedup::check_lease(lease)?;
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let (keys, tokens) = split_claims(claims);
        let (lease, window) = (ms(lease), ms(self.window));
        let sql = self.sql.clone();
        let done = self
            .with_retry("renew failed", move |client| {
                let (sql, keys, tokens) = (sql.clone(), keys.clone(), tokens.clone());
                Box::pin(async move {
                    let st = client.prepare_cached(&sql.renew).await?;
                    client.query(&st, &[&keys, &tokens, &lease, &window]).await
                })
            })
            .await?;
        Ok(flags(claims.iter().map(|(k, t)| (k.as_str(), *t)), &done))
    }

    async fn complete(&self, completions: &[Completion]) -> Result<Vec<bool>> {
        if completions.is_empty() {
            return Ok(Vec::new());
        }
        let mut sorted: Vec<&Completion> = completions.iter().collect();
        sorted.sort_by(|a, b| a.key.cmp(&b.key));
        let keys: Vec<String> = sorted.iter().map(|c| c.key.clone()).collect();
        let tokens: Vec<i64> = sorted.iter().map(|c| sql_token(c.token)).collect();
        let results: Vec<Option<Vec<u8>>> = sorted
            .iter()
            .map(|c| c.result.as_ref().map(|r| r.to_vec()))
            .collect();
        let window = ms(self.window);
        let sql = self.sql.clone();
        let done = self
            .with_retry("complete failed", move |client| {
                let (sql, keys, tokens, results) =
                    (sql.clone(), keys.clone(), tokens.clone(), results.clone());
                Box::pin(async move {
                    let st = client.prepare_cached(&sql.complete).await?;
                    client
                        .query(&st, &[&keys, &tokens, &results, &window])
                        .await
                })
            })
            .await?;
        Ok(flags(
            completions.iter().map(|c| (c.key.as_str(), c.token)),
            &done,
        ))
    }

    async fn release(&self, claims: &[(String, FencingToken)]) -> Result<Vec<bool>> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let (keys, tokens) = split_claims(claims);
        let sql = self.sql.clone();
        let done = self
            .with_retry("release failed", move |client| {
                let (sql, keys, tokens) = (sql.clone(), keys.clone(), tokens.clone());
                Box::pin(async move {
                    let st = client.prepare_cached(&sql.release).await?;
                    client.query(&st, &[&keys, &tokens]).await
                })
            })
            .await?;
        // A batch releasing one key twice with its token releases it once.
        let mut seen = std::collections::HashSet::new();
        Ok(flags(claims.iter().map(|(k, t)| (k.as_str(), *t)), &done)
            .into_iter()
            .zip(claims)
            .map(|(ok, c)| ok && seen.insert(c.clone()))
            .collect())
    }

    async fn get(&self, keys: &[String]) -> Result<Vec<Option<KeyState>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let client = self.db.client().await?;
        let sql = self.sql.clone();
        let asked = keys.to_vec();
        let (_client, rows) = self
            .db
            .timed("get failed", client, move |client| {
                Box::pin(async move {
                    let st = client.prepare_cached(&sql.get).await?;
                    client.query(&st, &[&asked]).await
                })
            })
            .await?;
        let rows = rows.map_err(|e| self.db.error("get failed", e))?;
        let found: std::collections::HashMap<String, (Row, i64)> = rows
            .iter()
            .map(|r| {
                let (k, row, now) = Row::from_pg(r);
                (k, (row, now))
            })
            .collect();
        Ok(keys
            .iter()
            .map(|k| {
                let (row, now) = found.get(k)?;
                if row.expires_at <= *now {
                    return None;
                }
                let fingerprint = fp_of(&row.fingerprint);
                let token = u64::try_from(row.token).unwrap_or(0);
                match row.state {
                    2 => Some(KeyState::Completed {
                        token,
                        result: row.result.clone().map(Bytes::from),
                        fingerprint,
                    }),
                    1 => Some(KeyState::InProgress {
                        owner: row.owner.clone().unwrap_or_default(),
                        token,
                        expires_in: Duration::from_millis(
                            u64::try_from(row.lease_until.unwrap_or(*now) - now).unwrap_or(0),
                        ),
                        fingerprint,
                    }),
                    _ => None,
                }
            })
            .collect())
    }
}

fn split_claims(claims: &[(String, FencingToken)]) -> (Vec<String>, Vec<i64>) {
    let mut sorted: Vec<&(String, FencingToken)> = claims.iter().collect();
    sorted.sort();
    (
        sorted.iter().map(|c| c.0.clone()).collect(),
        sorted.iter().map(|c| sql_token(c.1)).collect(),
    )
}

/// `true` for each (key, token) the statement returned.
fn flags<'a>(
    items: impl Iterator<Item = (&'a str, FencingToken)>,
    done: &[tokio_postgres::Row],
) -> Vec<bool> {
    let set: std::collections::HashSet<(String, i64)> =
        done.iter().map(|r| (r.get(0), r.get(1))).collect();
    items
        .map(|(k, t)| set.contains(&(k.to_string(), sql_token(t))))
        .collect()
}

/// This crate's entry in the backend registry (`onceflow_core::registry`): the schemes
/// `postgres://`, `postgresql://`, opening a [`PostgresStore`] (dedup) or a [`PostgresCheckpointStore`] (lease table). The
/// `onceflow` facade lists it.
pub const STORE: onceflow_core::registry::StoreEntry = onceflow_core::registry::StoreEntry {
    name: "postgres",
    schemes: &["postgres://", "postgresql://"],
    dedup: |url, window| {
        onceflow_core::registry::boxed(async move {
            let store: onceflow_core::dedup::SharedDedupStore =
                std::sync::Arc::new(PostgresStore::open(url.trim(), window).await?);
            Ok(store)
        })
    },
    checkpoint: |url| {
        onceflow_core::registry::boxed(async move {
            let store: onceflow_core::checkpoint::SharedCheckpointStore =
                std::sync::Arc::new(PostgresCheckpointStore::open(url.trim()).await?);
            Ok(store)
        })
    },
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_the_password_only() {
        assert_eq!(
            redact_url("postgres://onceflow:s3cret@127.0.0.1:15432/onceflow"),
            "postgres://onceflow:***@127.0.0.1:15432/onceflow"
        );
        assert_eq!(redact_url("postgres://u@h:1/db"), "postgres://u@h:1/db");
    }

    #[test]
    fn session_options_come_before_the_url_s() {
        assert_eq!(
            session_options(None),
            "-c plan_cache_mode=force_custom_plan"
        );
        assert_eq!(
            session_options(Some("-c work_mem=8MB")),
            "-c plan_cache_mode=force_custom_plan -c work_mem=8MB"
        );
    }

    #[tokio::test]
    async fn bad_urls_and_options_are_config_errors() {
        for url in [
            "mysql://u@127.0.0.1:1/db",
            "postgres://u:pw@127.0.0.1:1/db?schema=bad-name",
            "postgres://u:pw@127.0.0.1:1/db?pool_size=0",
            "postgres://u:pw@127.0.0.1:1/db?op_timeout=0",
            "postgres://u:pw@127.0.0.1:1/db?op_timeout=soon",
            // Positive, but rounds to a zero Duration: every operation would time out at once
            // (retriable, so the consumer retries for ever) (#28).
            "postgres://u:pw@127.0.0.1:1/db?op_timeout=1e-12",
        ] {
            let e = PostgresStore::open(url, Duration::from_secs(1))
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config, "{url}: {e}");
            assert!(!e.message().contains("pw@"), "{url}: {e}");
        }
    }

    /// A bad value of an option the PostgreSQL client reads is named with its value, not
    /// only "invalid connection string" (#28).
    #[tokio::test]
    async fn a_refused_option_is_named_with_its_value() {
        for (url, named) in [
            (
                "postgres://u:pw@127.0.0.1:1/db?connect_timeout=abc",
                "connect_timeout 'abc'",
            ),
            (
                "postgres://u:pw@127.0.0.1:1/db?connect_timeout=",
                "connect_timeout ''",
            ),
            (
                "postgres://u:pw@127.0.0.1:1/db?connect_timeout=0.0001",
                "connect_timeout '0.0001'",
            ),
            (
                "postgres://u:pw@127.0.0.1:1/db?connect_timeout=1e-12",
                "connect_timeout '1e-12'",
            ),
            // Positive, but 0.0 as an f64: not "wait indefinitely" (break-it bk28).
            (
                "postgres://u:pw@127.0.0.1:1/db?connect_timeout=1e-400",
                "connect_timeout '1e-400'",
            ),
            (
                "postgres://u:pw@127.0.0.1:1/db?connect_timeout=1e300",
                "connect_timeout '1e300'",
            ),
            (
                "postgres://u:pw@127.0.0.1:1/db?application_name=x&keepalives_idle=soon",
                "keepalives_idle='soon'",
            ),
            (
                "postgres://u@127.0.0.1:1/db?password=pw&target_session_attrs=any-old",
                "target_session_attrs='any-old'",
            ),
        ] {
            let e = PostgresStore::open(url, Duration::from_secs(1))
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config, "{url}: {e}");
            assert!(e.message().contains(named), "{url}: {e}");
            assert!(!e.message().contains("pw"), "{url}: {e}");
        }
    }
}
