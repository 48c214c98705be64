//! The admin REST API (<https://pulsar.apache.org/admin-rest-api/>): topics, partitions,
//! retention, subscription backlog and cursors.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use onceflow_core::{
    AdminBackend, Error, ErrorKind, PartitionLag, Position, Result, TopicDescription,
    TopicPartition, TopicSpec,
};
use serde_json::Value;

use crate::auth::Credentials;
use crate::config::check_topic;
use crate::Shared;

/// How a topic exists on the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TopicShape {
    /// No such topic.
    Missing,
    /// A non-partitioned topic: onceflow's partition 0.
    NonPartitioned,
    /// A partitioned topic with this many partitions (`NAME-partition-I`).
    Partitioned(u32),
}

impl TopicShape {
    /// Partition count in onceflow's model.
    pub(crate) fn partitions(self) -> u32 {
        match self {
            TopicShape::Missing => 0,
            TopicShape::NonPartitioned => 1,
            TopicShape::Partitioned(n) => n,
        }
    }
}

/// One subscription of one partition as the topic stats report it.
#[derive(Debug, Clone, Default)]
pub(crate) struct SubscriptionStats {
    /// `msgBacklog`: messages not yet acknowledged by the subscription.
    pub(crate) backlog: u64,
    /// `activeConsumerName` (failover / exclusive).
    pub(crate) active_consumer: Option<String>,
}

/// A small client of the admin REST API. Each request carries the connection's credential
/// as `Authorization: Bearer` (the token, the token file's current token, or the OAuth2
/// access token) and, for an `https://` admin URL, trusts the CAs of `tls_trust_certs`.
pub(crate) struct Rest {
    http: reqwest::Client,
    base: String,
    credentials: Credentials,
}

fn http_err(what: &str, e: reqwest::Error, client_cert: bool) -> Error {
    let what = onceflow_core::redact_credentials(what);
    if let Some(r) = crate::auth::rustls_error(&e) {
        let server = what
            .split_whitespace()
            .last()
            .unwrap_or_default()
            .to_string();
        let server = url::Url::parse(&server)
            .map(|u| u.origin().ascii_serialization())
            .unwrap_or(server);
        if matches!(
            r,
            rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
        ) {
            return crate::auth::certificate_error("Pulsar admin API", &server, r);
        }
        if let (rustls::Error::AlertReceived(alert), true) = (r, client_cert) {
            return Error::new(
                ErrorKind::Auth,
                format!(
                    "Pulsar admin API at {server} refused the TLS connection with our client \
                     certificate (TLS alert {alert:?}): is it signed by a CA the server trusts?"
                ),
            );
        }
    }
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else {
        ErrorKind::Connect
    };
    // The request's URL is in `what` (credentials removed); the native error's copy goes.
    let e = e.without_url();
    Error::new(kind, format!("Pulsar admin API, {what}: {e}")).with_source(e)
}

/// HTTP 401 / 403: the admin API refused the credential (or its absence).
fn refused(what: &str, status: u16, body: &str) -> Error {
    let why = if status == 401 {
        "refused the credentials (HTTP 401 Unauthorized)"
    } else {
        "refused the request (HTTP 403 Forbidden: the role may not do this)"
    };
    // Jetty's 401 page is HTML: only a JSON (or plain) reason is worth quoting.
    let body = body.trim();
    let body = if body.starts_with('<') { "" } else { body };
    Error::new(
        ErrorKind::Auth,
        format!(
            "Pulsar admin API, {}: {why}{}",
            onceflow_core::redact_credentials(what),
            if body.is_empty() {
                String::new()
            } else {
                format!(": {}", onceflow_core::shown(body))
            }
        ),
    )
}

impl Rest {
    /// A client of the admin API at `base`. `trusted`: PEM CA certificates to trust besides
    /// the public web PKI. `mtls`: with a client certificate, the TLS configuration of the
    /// mTLS bridge (the same trusted CAs, client certificate and broker certificate check),
    /// used as it is for `https://`.
    pub(crate) fn new(
        base: &str,
        timeout: std::time::Duration,
        trusted: Option<&[u8]>,
        mtls: Option<rustls::ClientConfig>,
        credentials: Credentials,
    ) -> Result<Rest> {
        let mut builder = reqwest::Client::builder().timeout(timeout);
        if let Some(config) = mtls {
            builder = builder.use_preconfigured_tls(config);
        } else if let Some(pem) = trusted {
            for c in reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| Error::config(format!("tls_trust_certs: {e}")))?
            {
                builder = builder.add_root_certificate(c);
            }
        }
        let http = builder
            .build()
            .map_err(|e| Error::config(format!("cannot build the admin HTTP client: {e}")))?;
        Ok(Rest {
            http,
            base: base.trim_end_matches('/').to_string(),
            credentials,
        })
    }

    /// `req` with the credential.
    async fn authorized(&self, req: reqwest::RequestBuilder) -> Result<reqwest::RequestBuilder> {
        // The auth method header, as Pulsar's Java admin client sends it: without it the broker
        // tries each provider and, when all refuse the token, serves the request as its
        // `anonymousUserRole` (where one is set) instead of answering 401.
        // With a client certificate the TLS layer presents it: only the method is named.
        let req = match self.credentials.http_method() {
            Some(m) => req.header("X-Pulsar-Auth-Method-Name", m),
            None => req,
        };
        Ok(match self.credentials.bearer().await? {
            Some(t) => req.bearer_auth(t),
            None => req,
        })
    }

    fn client_cert(&self) -> bool {
        matches!(self.credentials, Credentials::ClientCert)
    }

    fn url(&self, path: &str) -> String {
        format!("{}/admin/v2/persistent/{path}", self.base)
    }

    /// GET returning the status and the JSON body (`Null` when empty or not JSON).
    async fn get(&self, path: &str) -> Result<(u16, Value)> {
        let url = self.url(path);
        let resp = self
            .authorized(self.http.get(&url))
            .await?
            .send()
            .await
            .map_err(|e| http_err(&format!("GET {url}"), e, self.client_cert()))?;
        let status = resp.status().as_u16();
        let text = resp
            .text()
            .await
            .map_err(|e| http_err(&format!("GET {url}"), e, self.client_cert()))?;
        if status == 401 || status == 403 {
            return Err(refused(&format!("GET {url}"), status, &text));
        }
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, String)> {
        let url = self.url(path);
        let mut req = self
            .authorized(self.http.request(method.clone(), &url))
            .await?;
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| http_err(&format!("{method} {url}"), e, self.client_cert()))?;
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        if status == 401 || status == 403 {
            return Err(refused(&format!("{method} {url}"), status, &text));
        }
        Ok((status, text))
    }

    fn unexpected(what: &str, status: u16, body: &str) -> Error {
        Error::new(
            ErrorKind::Platform,
            format!(
                "Pulsar admin API, {}: HTTP {status}: {body}",
                onceflow_core::redact_credentials(what)
            ),
        )
    }

    /// Whether the broker acknowledges single messages of a batch (PIP-54): its runtime
    /// configuration (`GET /admin/v2/brokers/configuration/runtime`, a JSON object of strings)
    /// says `acknowledgmentAtBatchIndexLevelEnabled` is `true`. `Platform` error on another
    /// answer (a role that may not read broker configuration gets HTTP 401/403).
    pub(crate) async fn batch_index_ack(&self) -> Result<bool> {
        let url = format!("{}/admin/v2/brokers/configuration/runtime", self.base);
        let what = format!("GET {url}");
        let resp = self
            .authorized(self.http.get(&url))
            .await?
            .send()
            .await
            .map_err(|e| http_err(&what, e, self.client_cert()))?;
        let status = resp.status().as_u16();
        let text = resp
            .text()
            .await
            .map_err(|e| http_err(&what, e, self.client_cert()))?;
        if status != 200 {
            return Err(Self::unexpected(&what, status, ""));
        }
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        Ok(v.get("acknowledgmentAtBatchIndexLevelEnabled")
            .and_then(Value::as_str)
            .is_some_and(|s| s.eq_ignore_ascii_case("true")))
    }

    /// Whether `path` is a partitioned topic, a plain one or missing.
    pub(crate) async fn shape(&self, path: &str) -> Result<TopicShape> {
        let (status, v) = self.get(&format!("{path}/partitions")).await?;
        if status == 200 {
            if let Some(n) = v.get("partitions").and_then(Value::as_u64) {
                if n > 0 {
                    return Ok(TopicShape::Partitioned(n as u32));
                }
            }
        }
        let (status, _) = self.get(&format!("{path}/stats")).await?;
        match status {
            200 => Ok(TopicShape::NonPartitioned),
            404 => Ok(TopicShape::Missing),
            s => Err(Self::unexpected(&format!("stats of {path}"), s, "")),
        }
    }

    /// Per-partition stats of subscription `sub` (`None` where the partition has no such
    /// subscription), index = partition.
    pub(crate) async fn subscription_stats(
        &self,
        path: &str,
        shape: TopicShape,
        sub: &str,
    ) -> Result<Vec<Option<SubscriptionStats>>> {
        let read = |v: &Value| -> Option<SubscriptionStats> {
            let s = v.get("subscriptions")?.get(sub)?;
            Some(SubscriptionStats {
                backlog: s.get("msgBacklog").and_then(Value::as_u64).unwrap_or(0),
                active_consumer: s
                    .get("activeConsumerName")
                    .and_then(Value::as_str)
                    .map(String::from),
            })
        };
        match shape {
            TopicShape::Missing => Ok(Vec::new()),
            TopicShape::NonPartitioned => {
                let (status, v) = self.get(&format!("{path}/stats")).await?;
                if status != 200 {
                    return Err(Self::unexpected(
                        &format!("stats of {path}"),
                        status,
                        &v.to_string(),
                    ));
                }
                Ok(vec![read(&v)])
            }
            TopicShape::Partitioned(n) => {
                let (status, v) = self
                    .get(&format!("{path}/partitioned-stats?perPartition=true"))
                    .await?;
                if status != 200 {
                    return Err(Self::unexpected(
                        &format!("partitioned stats of {path}"),
                        status,
                        &v.to_string(),
                    ));
                }
                let parts = v.get("partitions");
                Ok((0..n)
                    .map(|i| {
                        let name = format!("{path}-partition-{i}");
                        parts.and_then(|p| {
                            p.as_object().and_then(|o| {
                                o.iter()
                                    .find(|(k, _)| k.ends_with(&name))
                                    .and_then(|(_, s)| read(s))
                            })
                        })
                    })
                    .collect())
            }
        }
    }

    /// `markDeletePosition` (`ledger:entry`) of subscription `sub` on one partition topic
    /// path, if the cursor exists.
    pub(crate) async fn mark_delete(
        &self,
        partition_path: &str,
        sub: &str,
    ) -> Result<Option<(u64, i64)>> {
        let (status, v) = self.get(&format!("{partition_path}/internalStats")).await?;
        if status == 404 {
            return Ok(None);
        }
        if status != 200 {
            return Err(Self::unexpected(
                &format!("internal stats of {partition_path}"),
                status,
                &v.to_string(),
            ));
        }
        let Some(md) = v
            .get("cursors")
            .and_then(|c| c.get(sub))
            .and_then(|c| c.get("markDeletePosition"))
            .and_then(Value::as_str)
        else {
            return Ok(None);
        };
        let mut it = md.split(':');
        let l = it.next().and_then(|x| x.parse().ok());
        let e = it.next().and_then(|x| x.parse().ok());
        Ok(l.zip(e))
    }
}

/// Topic administration on Pulsar through the admin REST API.
pub struct PulsarAdmin {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for PulsarAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarAdmin")
            .field("admin", &self.shared.options.admin_url)
            .finish()
    }
}

fn minutes(ms: u64) -> i64 {
    ms.div_ceil(60_000) as i64
}

fn megabytes(bytes: u64) -> i64 {
    bytes.div_ceil(1024 * 1024) as i64
}

impl PulsarAdmin {
    async fn set_retention(&self, path: &str, spec: &TopicSpec) -> Result<()> {
        if spec.retention_ms.is_none() && spec.retention_bytes.is_none() {
            return Ok(());
        }
        let body = serde_json::json!({
            "retentionTimeInMinutes": spec.retention_ms.map(minutes).unwrap_or(-1),
            "retentionSizeInMB": spec.retention_bytes.map(megabytes).unwrap_or(-1),
        });
        let (status, text) = self
            .shared
            .rest
            .send(
                reqwest::Method::POST,
                &format!("{path}/retention"),
                Some(body),
            )
            .await?;
        if !(200..300).contains(&status) {
            return Err(Rest::unexpected(
                &format!("retention of topic '{}'", spec.name),
                status,
                &text,
            ));
        }
        Ok(())
    }

    async fn retention(&self, path: &str) -> (Option<u64>, Option<u64>) {
        match self.shared.rest.get(&format!("{path}/retention")).await {
            Ok((200, v)) => {
                let t = v.get("retentionTimeInMinutes").and_then(Value::as_i64);
                let s = v.get("retentionSizeInMB").and_then(Value::as_i64);
                (
                    t.filter(|t| *t >= 0).map(|t| t as u64 * 60_000),
                    s.filter(|s| *s >= 0).map(|s| s as u64 * 1024 * 1024),
                )
            }
            _ => (None, None),
        }
    }
}

#[async_trait]
impl AdminBackend for PulsarAdmin {
    /// One partition: a non-partitioned topic (`PUT /admin/v2/persistent/T`); more: a
    /// partitioned topic (`PUT …/T/partitions`). Retention goes to the topic-level policy
    /// (`POST …/T/retention`, minutes and MiB rounded up; the unset one is unlimited, -1).
    /// Compaction is not offered (`Unsupported`).
    async fn create_topic(&self, spec: &TopicSpec) -> Result<()> {
        check_topic(&spec.name)?;
        if spec.partitions == 0 {
            return Err(Error::config(format!(
                "topic '{}' with 0 partitions: expected >= 1",
                spec.name
            )));
        }
        if spec.compacted {
            return Err(Error::unsupported(format!(
                "topic '{}': compaction is not offered by onceflow's Pulsar adapter",
                spec.name
            )));
        }
        if let Some(k) = spec.options.keys().next() {
            return Err(Error::config(format!(
                "topic '{}': unknown topic option '{k}': the Pulsar adapter takes none",
                spec.name
            )));
        }
        let path = self.shared.options.admin_path(&spec.name);
        let (status, text) = if spec.partitions == 1 {
            self.shared
                .rest
                .send(reqwest::Method::PUT, &path, None)
                .await?
        } else {
            self.shared
                .rest
                .send(
                    reqwest::Method::PUT,
                    &format!("{path}/partitions"),
                    Some(Value::from(spec.partitions)),
                )
                .await?
        };
        match status {
            200..=299 => {}
            409 => {
                let have = self.shared.rest.shape(&path).await?.partitions();
                if have != spec.partitions {
                    return Err(Error::config(format!(
                        "topic '{}' exists with {have} partitions, not {}",
                        spec.name, spec.partitions
                    )));
                }
            }
            s => {
                return Err(Rest::unexpected(
                    &format!("creating topic '{}'", spec.name),
                    s,
                    &text,
                ))
            }
        }
        self.set_retention(&path, spec).await?;
        self.shared.forget_topic(&spec.name);
        Ok(())
    }

    async fn describe_topic(&self, name: &str) -> Result<TopicDescription> {
        check_topic(name)?;
        let path = self.shared.options.admin_path(name);
        let shape = self.shared.rest.shape(&path).await?;
        if shape == TopicShape::Missing {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("topic '{name}' does not exist on Pulsar"),
            ));
        }
        let (retention_ms, retention_bytes) = self.retention(&path).await;
        let mut options = BTreeMap::new();
        options.insert(
            "partitioned".to_string(),
            matches!(shape, TopicShape::Partitioned(_)).to_string(),
        );
        options.insert(
            "full_name".to_string(),
            self.shared.options.full_topic(name),
        );
        let n = shape.partitions();
        Ok(TopicDescription {
            name: name.to_string(),
            partitions: n,
            retention_ms,
            retention_bytes,
            compacted: false,
            // Pulsar message ids of the first and the next message are not known without
            // reading the ledgers; see the crate docs.
            watermarks: vec![(None, None); n as usize],
            options,
        })
    }

    async fn delete_topic(&self, name: &str) -> Result<()> {
        check_topic(name)?;
        let path = self.shared.options.admin_path(name);
        let shape = self.shared.rest.shape(&path).await?;
        let target = match shape {
            TopicShape::Missing => {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("topic '{name}' does not exist on Pulsar"),
                ))
            }
            TopicShape::NonPartitioned => format!("{path}?force=true"),
            TopicShape::Partitioned(_) => format!("{path}/partitions?force=true"),
        };
        let (status, text) = self
            .shared
            .rest
            .send(reqwest::Method::DELETE, &target, None)
            .await?;
        self.shared.forget_topic(name);
        match status {
            200..=299 => Ok(()),
            404 => Err(Error::new(
                ErrorKind::NotFound,
                format!("topic '{name}' does not exist on Pulsar"),
            )),
            s => Err(Rest::unexpected(
                &format!("deleting topic '{name}'"),
                s,
                &text,
            )),
        }
    }

    /// `msgBacklog` of subscription `group` on every partition (topic stats), read without
    /// connecting a consumer.
    async fn group_lag(&self, group: &str, topic: &str) -> Result<Vec<PartitionLag>> {
        check_topic(topic)?;
        let path = self.shared.options.admin_path(topic);
        let shape = self.shared.rest.shape(&path).await?;
        if shape == TopicShape::Missing {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("topic '{topic}' does not exist on Pulsar"),
            ));
        }
        let stats = self
            .shared
            .rest
            .subscription_stats(&path, shape, group)
            .await?;
        if stats.iter().all(Option::is_none) {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("group '{group}' has no subscription on topic '{topic}'"),
            ));
        }
        let partitioned = matches!(shape, TopicShape::Partitioned(_));
        let mut out = Vec::with_capacity(stats.len());
        for (i, s) in stats.into_iter().enumerate() {
            let ppath = if partitioned {
                format!("{path}-partition-{i}")
            } else {
                path.clone()
            };
            let committed =
                committed_from_cursor(&self.shared, &ppath, group, partitioned.then_some(i as i32))
                    .await?;
            out.push(PartitionLag {
                partition: TopicPartition::new(topic, i as i32),
                committed,
                high_watermark: None,
                messages: s.map(|s| s.backlog).unwrap_or(0),
                millis: None,
            });
        }
        Ok(out)
    }
}

/// The committed position read from the subscription's cursor: `None` while the mark-delete
/// position is before the first entry (entry -1), else the entry after it in the same ledger.
/// Exact while the next message is in the same ledger and not in a batch; a message id in a
/// ledger rolled over since reads as the entry after the last one of the old ledger.
pub(crate) async fn committed_from_cursor(
    shared: &Shared,
    partition_path: &str,
    sub: &str,
    partition: Option<i32>,
) -> Result<Option<Position>> {
    Ok(shared
        .rest
        .mark_delete(partition_path, sub)
        .await?
        .filter(|(_, e)| *e >= 0)
        .map(|(l, e)| Position::MessageId {
            ledger: l,
            entry: e as u64 + 1,
            partition: partition.unwrap_or(-1),
            batch: -1,
        }))
}
