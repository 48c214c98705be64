//! The client side of Pulsar's transaction coordinator protocol (PIP-31,
//! <https://github.com/apache/pulsar/wiki/PIP-31%3A-Transaction-Support>; Pulsar docs,
//! "Transactions", <https://pulsar.apache.org/docs/next/txn-how/>), on onceflow's own broker
//! connections ([`Wire`]): the pulsar crate has no transactions (streamnative/pulsar-rs#253).
//!
//! A cluster runs one transaction coordinator (TC) per partition of the system topic
//! `persistent://pulsar/system/transaction_coordinator_assign` (brokers need
//! `transactionCoordinatorEnabled=true`); TC `n` lives on the broker that owns partition `n`.
//! [`Coordinators`] finds them (`PARTITIONED_METADATA`, then `LOOKUP` per partition), opens
//! one connection per TC (`TC_CLIENT_CONNECT_REQUEST`) and sends:
//! - `NEW_TXN` (round robin over the TCs, with the transaction's timeout): the [`TxnId`], whose
//!   most significant bits are the TC's id;
//! - `ADD_PARTITION_TO_TXN` before the first message is sent to a topic partition in the
//!   transaction, and `ADD_SUBSCRIPTION_TO_TXN` before the first acknowledgement on a
//!   subscription: the TC writes the commit or abort marker to exactly these at the end;
//! - `END_TXN` with `COMMIT` or `ABORT`.
//!
//! A TC that moved (its broker restarted or unloaded the topic) or a lost connection is found
//! again and the request sent again, with backoff, within the operation timeout. `END_TXN` is
//! sent again likewise; if the first attempt's answer was lost and the second finds the
//! transaction already ended, the outcome is reported as unknown (retriable `Timeout`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_core::{Error, ErrorKind, Result};
use pulsar::proto::{self, base_command::Type, BaseCommand};

use crate::wire::{command, server_error, BrokerAddr, Wire, WireConfig};

/// The system topic whose partitions place the transaction coordinators.
const TC_ASSIGN_TOPIC: &str = "persistent://pulsar/system/transaction_coordinator_assign";
/// Lookup redirects followed at most.
const MAX_REDIRECTS: usize = 8;

/// A Pulsar transaction id (Java's `TxnID`): `most_bits` is the coordinator's id,
/// `least_bits` the coordinator's sequence. Shown as `(most,least)`, as Pulsar's admin API
/// and logs show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TxnId {
    /// Most significant bits: the id of the transaction coordinator that owns it.
    pub most_bits: u64,
    /// Least significant bits: the sequence within that coordinator.
    pub least_bits: u64,
}

impl std::fmt::Display for TxnId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({},{})", self.most_bits, self.least_bits)
    }
}

/// How a transaction ends (`END_TXN`'s `TxnAction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TxnEnd {
    Commit,
    Abort,
}

/// The transaction coordinators of one cluster, and connections to them (see the module docs).
pub(crate) struct Coordinators {
    config: WireConfig,
    service: BrokerAddr,
    /// Number of coordinators (partitions of [`TC_ASSIGN_TOPIC`]).
    count: u64,
    /// The connection to the service URL's broker (lookups), then one per coordinator.
    service_wire: tokio::sync::Mutex<Option<Arc<Wire>>>,
    wires: tokio::sync::Mutex<HashMap<u64, Arc<Wire>>>,
    next: AtomicU64,
}

impl std::fmt::Debug for Coordinators {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinators")
            .field("service", &self.service.to_string())
            .field("count", &self.count)
            .finish_non_exhaustive()
    }
}

/// A coordinator's `TransactionNotFound` (`NotFound`) answer to registering a partition or a
/// subscription: the transaction is no longer open there (the coordinator aborted it at
/// `transaction_timeout_ms`, or it was ended), so the transaction is `Aborted`, as its commit
/// then is; not `NotFound`, which names a missing topic or subscription. Other errors pass.
fn no_longer_open(txn: TxnId, what: &str, e: Error) -> Error {
    if e.kind() != ErrorKind::NotFound {
        return e;
    }
    Error::new(
        ErrorKind::Aborted,
        format!(
            "cannot {what} Pulsar transaction {txn}: its coordinator no longer has it open (it \
             ran past transaction_timeout_ms and was aborted, or was ended): {}",
            e.message()
        ),
    )
}

impl Coordinators {
    /// Finds the cluster's coordinators through the broker at `service`. `Unsupported` when
    /// the cluster has none (`transactionCoordinatorEnabled=false`).
    pub(crate) async fn discover(config: WireConfig, service: BrokerAddr) -> Result<Coordinators> {
        let wire = Arc::new(Wire::connect(&config, &service, None).await?);
        let id = wire.next_request_id();
        let mut c = command(Type::PartitionedMetadata);
        c.partition_metadata = Some(proto::CommandPartitionedTopicMetadata {
            topic: TC_ASSIGN_TOPIC.to_string(),
            request_id: id,
            ..Default::default()
        });
        let answer = wire.request(id, c).await?;
        let server = service.to_string();
        let count = match answer.partition_metadata_response {
            Some(r) if r.error.is_none() => u64::from(r.partitions.unwrap_or(0)),
            Some(r) => {
                return Err(server_error(
                    &server,
                    "the lookup of the transaction coordinators",
                    r.error.unwrap_or_default(),
                    r.message.as_deref().unwrap_or_default(),
                ))
            }
            None => return Err(unexpected(&server, "PARTITIONED_METADATA", answer.r#type)),
        };
        if count == 0 {
            return Err(Error::unsupported(format!(
                "the Pulsar cluster at {server} runs no transaction coordinator: transactions \
                 need transactionCoordinatorEnabled=true in the brokers' broker.conf (and the \
                 coordinators initialised: `pulsar initialize-transaction-coordinator-metadata` \
                 on a cluster, automatic on standalone)"
            )));
        }
        Ok(Coordinators {
            config,
            service,
            count,
            service_wire: tokio::sync::Mutex::new(Some(wire)),
            wires: tokio::sync::Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        })
    }

    /// The number of coordinators of the cluster.
    #[cfg(test)]
    pub(crate) fn count(&self) -> u64 {
        self.count
    }

    /// Opens a transaction with `timeout` (whole milliseconds, at least one): the coordinator
    /// aborts it by itself when it is still open then.
    ///
    /// `NEW_TXN`'s field is named `txn_ttl_seconds`, but brokers read it as milliseconds (the
    /// Java client sends `unit.toMillis(timeout)`, and the admin API's `timeoutAt` shows it
    /// back as such); so does onceflow.
    pub(crate) async fn new_txn(&self, timeout: Duration) -> Result<TxnId> {
        let tc = self.next.fetch_add(1, Ordering::Relaxed) % self.count;
        let ttl = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let answer = self
            .call(tc, "NEW_TXN", |id| {
                let mut c = command(Type::NewTxn);
                c.new_txn = Some(proto::CommandNewTxn {
                    request_id: id,
                    txn_ttl_seconds: Some(ttl.max(1)),
                    tc_id: Some(tc),
                });
                c
            })
            .await?;
        let ty = answer.r#type;
        let r = answer
            .new_txn_response
            .ok_or_else(|| unexpected(&self.service.to_string(), "NEW_TXN", ty))?;
        Ok(TxnId {
            most_bits: r.txnid_most_bits.unwrap_or(tc),
            least_bits: r.txnid_least_bits.unwrap_or(0),
        })
    }

    /// Registers topic partitions (full names, `persistent://tenant/ns/topic[-partition-N]`)
    /// the transaction sends to; before the first send to each.
    pub(crate) async fn add_partitions(&self, txn: TxnId, partitions: &[String]) -> Result<()> {
        self.call(txn.most_bits, "ADD_PARTITION_TO_TXN", |id| {
            let mut c = command(Type::AddPartitionToTxn);
            c.add_partition_to_txn = Some(proto::CommandAddPartitionToTxn {
                request_id: id,
                txnid_least_bits: Some(txn.least_bits),
                txnid_most_bits: Some(txn.most_bits),
                partitions: partitions.to_vec(),
            });
            c
        })
        .await
        .map(drop)
        .map_err(|e| no_longer_open(txn, "send in", e))
    }

    /// Registers subscriptions (`(full topic partition name, subscription)`) the transaction
    /// acknowledges on; before the first acknowledgement on each.
    pub(crate) async fn add_subscriptions(
        &self,
        txn: TxnId,
        subscriptions: &[(String, String)],
    ) -> Result<()> {
        self.call(txn.most_bits, "ADD_SUBSCRIPTION_TO_TXN", |id| {
            let mut c = command(Type::AddSubscriptionToTxn);
            c.add_subscription_to_txn = Some(proto::CommandAddSubscriptionToTxn {
                request_id: id,
                txnid_least_bits: Some(txn.least_bits),
                txnid_most_bits: Some(txn.most_bits),
                subscription: subscriptions
                    .iter()
                    .map(|(topic, subscription)| proto::Subscription {
                        topic: topic.clone(),
                        subscription: subscription.clone(),
                    })
                    .collect(),
            });
            c
        })
        .await
        .map(drop)
        .map_err(|e| no_longer_open(txn, "acknowledge in", e))
    }

    /// Commits or aborts. A transaction the coordinator no longer has open (it timed out and
    /// was aborted, or was ended already) is `Aborted` on commit; when an earlier attempt of
    /// this call may have ended it (its answer was lost), `Timeout` with the outcome unknown.
    pub(crate) async fn end(&self, txn: TxnId, end: TxnEnd) -> Result<()> {
        let action = match end {
            TxnEnd::Commit => proto::TxnAction::Commit,
            TxnEnd::Abort => proto::TxnAction::Abort,
        };
        let mut attempts = 0u32;
        let result = self
            .call_counting(txn.most_bits, "END_TXN", &mut attempts, |id| {
                let mut c = command(Type::EndTxn);
                c.end_txn = Some(proto::CommandEndTxn {
                    request_id: id,
                    txnid_least_bits: Some(txn.least_bits),
                    txnid_most_bits: Some(txn.most_bits),
                    txn_action: Some(action as i32),
                });
                c
            })
            .await;
        let verb = match end {
            TxnEnd::Commit => "commit",
            TxnEnd::Abort => "abort",
        };
        match result {
            Ok(_) => Ok(()),
            Err(e)
                if attempts > 1 && matches!(e.kind(), ErrorKind::Aborted | ErrorKind::NotFound) =>
            {
                Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the outcome of the {} of Pulsar transaction {txn} is unknown: the \
                         coordinator's answer was lost, and asked again it no longer has the \
                         transaction open ({})",
                        if end == TxnEnd::Commit {
                            "commit"
                        } else {
                            "abort"
                        },
                        e.message()
                    ),
                )
                .retriable(true)
                .with_outcome_unknown())
            }
            Err(e) if end == TxnEnd::Commit && e.kind() == ErrorKind::NotFound => Err(Error::new(
                ErrorKind::Aborted,
                format!(
                    "Pulsar transaction {txn} was aborted before its commit (it timed out, or \
                     was aborted): {}",
                    e.message()
                ),
            )),
            // No answer in time (the request may have reached the coordinator): say which
            // request, and that the transaction may still end so.
            Err(e) if e.outcome_unknown() => Err(Error::new(
                e.kind(),
                format!(
                    "the outcome of the {verb} of Pulsar transaction {txn} is unknown (it \
                     may still {verb}): {}",
                    e.message()
                ),
            )
            .retriable(e.is_retriable())
            .with_outcome_unknown()),
            Err(e) => Err(e),
        }
    }

    /// Sends the request `build` makes (given a request id) to coordinator `tc` and returns its
    /// answer; connections found lost and coordinators that moved are found again and the
    /// request sent again, with backoff, within the operation timeout.
    async fn call(
        &self,
        tc: u64,
        what: &str,
        build: impl Fn(u64) -> BaseCommand,
    ) -> Result<BaseCommand> {
        let mut attempts = 0;
        self.call_counting(tc, what, &mut attempts, build).await
    }

    async fn call_counting(
        &self,
        tc: u64,
        what: &str,
        attempts: &mut u32,
        build: impl Fn(u64) -> BaseCommand,
    ) -> Result<BaseCommand> {
        let deadline = tokio::time::Instant::now() + self.config.timeout;
        let mut pause = Duration::from_millis(50);
        loop {
            *attempts += 1;
            let attempt = async {
                let wire = self.tc_wire(tc).await?;
                let id = wire.next_request_id();
                let answer = wire.request(id, build(id)).await?;
                answer_error(&wire.addr().to_string(), what, &answer).map(|()| answer)
            }
            .await;
            match attempt {
                Ok(answer) => return Ok(answer),
                Err(e) if e.is_retriable() && tokio::time::Instant::now() + pause < deadline => {
                    tracing::debug!(tc, error = %e, "Pulsar transaction coordinator: trying again");
                    self.wires.lock().await.remove(&tc);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The connection to coordinator `tc`, opened (lookup, connect, `TC_CLIENT_CONNECT`) if
    /// there is none or it was lost.
    async fn tc_wire(&self, tc: u64) -> Result<Arc<Wire>> {
        let mut wires = self.wires.lock().await;
        if let Some(w) = wires.get(&tc) {
            if !w.is_closed() {
                return Ok(w.clone());
            }
        }
        let topic = format!("{TC_ASSIGN_TOPIC}-partition-{tc}");
        let (addr, proxy) = self.lookup(&topic).await?;
        let wire = Arc::new(match &proxy {
            Some(url) => Wire::connect(&self.config, &self.service, Some(url.clone())).await?,
            None => Wire::connect(&self.config, &addr, None).await?,
        });
        let id = wire.next_request_id();
        let mut c = command(Type::TcClientConnectRequest);
        c.tc_client_connect_request = Some(proto::CommandTcClientConnectRequest {
            request_id: id,
            tc_id: tc,
        });
        let answer = wire.request(id, c).await?;
        answer_error(&addr.to_string(), "TC_CLIENT_CONNECT", &answer)?;
        wires.insert(tc, wire.clone());
        Ok(wire)
    }

    /// The broker that owns `topic` (following redirects), and the broker URL to name to a
    /// Pulsar proxy when the answer says to go through the service URL.
    async fn lookup(&self, topic: &str) -> Result<(BrokerAddr, Option<String>)> {
        use proto::command_lookup_topic_response::LookupType;
        let mut wire = self.service_wire().await?;
        let mut authoritative = false;
        for _ in 0..MAX_REDIRECTS {
            let id = wire.next_request_id();
            let mut c = command(Type::Lookup);
            c.lookup_topic = Some(proto::CommandLookupTopic {
                topic: topic.to_string(),
                request_id: id,
                authoritative: Some(authoritative),
                ..Default::default()
            });
            let server = wire.addr().to_string();
            let answer = wire.request(id, c).await?;
            let ty = answer.r#type;
            let r = answer
                .lookup_topic_response
                .ok_or_else(|| unexpected(&server, "LOOKUP", ty))?;
            let url = if self.service.tls {
                r.broker_service_url_tls.clone()
            } else {
                r.broker_service_url.clone()
            };
            match r.response.and_then(|t| LookupType::try_from(t).ok()) {
                Some(LookupType::Connect) | Some(LookupType::Redirect) => {
                    let url = url.ok_or_else(|| {
                        Error::new(
                            ErrorKind::Platform,
                            format!(
                                "Pulsar at {server} answered the lookup of {topic} without a {} \
                                 broker address",
                                if self.service.tls { "TLS" } else { "plaintext" }
                            ),
                        )
                    })?;
                    let addr = BrokerAddr::of_url(&url).ok_or_else(|| {
                        Error::new(
                            ErrorKind::Platform,
                            format!("Pulsar at {server} named the broker '{url}' for {topic}"),
                        )
                    })?;
                    let proxy = r.proxy_through_service_url == Some(true);
                    if r.response == Some(LookupType::Connect as i32) {
                        return Ok((addr, proxy.then_some(url)));
                    }
                    authoritative = r.authoritative.unwrap_or(false);
                    wire = if proxy {
                        Arc::new(Wire::connect(&self.config, &self.service, Some(url)).await?)
                    } else {
                        Arc::new(Wire::connect(&self.config, &addr, None).await?)
                    };
                }
                _ => {
                    return Err(server_error(
                        &server,
                        &format!("the lookup of {topic}"),
                        r.error.unwrap_or_default(),
                        r.message.as_deref().unwrap_or_default(),
                    ))
                }
            }
        }
        Err(Error::new(
            ErrorKind::Platform,
            format!("the lookup of {topic} was redirected more than {MAX_REDIRECTS} times"),
        ))
    }

    async fn service_wire(&self) -> Result<Arc<Wire>> {
        let mut w = self.service_wire.lock().await;
        if let Some(wire) = w.as_ref() {
            if !wire.is_closed() {
                return Ok(wire.clone());
            }
        }
        let wire = Arc::new(Wire::connect(&self.config, &self.service, None).await?);
        *w = Some(wire.clone());
        Ok(wire)
    }
}

/// The error an answer carries (`ERROR`, or the `error` of a transaction command's answer).
fn answer_error(server: &str, what: &str, c: &BaseCommand) -> Result<()> {
    let (code, message) = if let Some(e) = &c.error {
        (Some(e.error), e.message.clone())
    } else if let Some(r) = &c.tc_client_connect_response {
        (r.error, r.message.clone().unwrap_or_default())
    } else if let Some(r) = &c.new_txn_response {
        (r.error, r.message.clone().unwrap_or_default())
    } else if let Some(r) = &c.add_partition_to_txn_response {
        (r.error, r.message.clone().unwrap_or_default())
    } else if let Some(r) = &c.add_subscription_to_txn_response {
        (r.error, r.message.clone().unwrap_or_default())
    } else if let Some(r) = &c.end_txn_response {
        (r.error, r.message.clone().unwrap_or_default())
    } else {
        (None, String::new())
    };
    match code {
        Some(code) => Err(server_error(server, what, code, &message)),
        None => Ok(()),
    }
}

fn unexpected(server: &str, what: &str, ty: i32) -> Error {
    let name = Type::try_from(ty).map_or_else(|_| ty.to_string(), |t| format!("{t:?}"));
    Error::new(
        ErrorKind::Platform,
        format!("Pulsar at {server} answered {what} with an unexpected command ({name})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn txn_ids_show_as_pulsar_shows_them() {
        let t = TxnId {
            most_bits: 0,
            least_bits: 42,
        };
        assert_eq!(t.to_string(), "(0,42)");
    }

    #[test]
    fn transaction_errors_in_answers() {
        let mut c = command(Type::EndTxnResponse);
        c.end_txn_response = Some(proto::CommandEndTxnResponse {
            request_id: 1,
            error: Some(proto::ServerError::TransactionNotFound as i32),
            message: Some("gone".into()),
            ..Default::default()
        });
        let e = answer_error("pulsar://b:1", "END_TXN", &c).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        c.end_txn_response.as_mut().unwrap().error = None;
        assert!(answer_error("pulsar://b:1", "END_TXN", &c).is_ok());
    }

    /// The broker's view of a transaction (admin API v3, `transactionMetadata`): its status
    /// and the partitions / subscriptions registered, `None` once the coordinator forgot it.
    async fn metadata(admin: &str, t: TxnId) -> Option<serde_json::Value> {
        let url = format!(
            "{admin}/admin/v3/transactions/transactionMetadata/{}/{}",
            t.most_bits, t.least_bits
        );
        let r = reqwest::get(&url).await.expect("admin API");
        if !r.status().is_success() {
            return None;
        }
        Some(r.json().await.expect("JSON"))
    }

    fn broker() -> Option<(String, String)> {
        let url =
            onceflow_conformance::harness::broker_url("ONCEFLOW_PULSAR_URL", "pulsar").ok()?;
        let admin = std::env::var("ONCEFLOW_PULSAR_ADMIN_URL").expect("ONCEFLOW_PULSAR_ADMIN_URL");
        let sep = if url.contains('?') { '&' } else { '?' };
        Some((format!("{url}{sep}admin={admin}"), admin))
    }

    /// NEW_TXN, ADD_PARTITION_TO_TXN, ADD_SUBSCRIPTION_TO_TXN and END_TXN against the real
    /// coordinator of `tests/brokers/up.sh pulsar`, checked through the broker's admin API.
    #[tokio::test]
    async fn coordinator_protocol_on_the_broker() {
        let Some((url, admin)) = broker() else { return };
        let platform = crate::connect(&url).await.expect("connect");
        let tcs = platform.shared.coordinators().await.expect("coordinators");
        assert!(tcs.count() >= 1);

        let t = tcs.new_txn(Duration::from_secs(60)).await.expect("NEW_TXN");
        let m = metadata(&admin, t).await.expect("an open transaction");
        assert_eq!(m["status"], "OPEN", "{m}");
        assert_eq!(m["timeoutAt"], 60_000, "the timeout in ms: {m}");

        let topic = "persistent://public/default/onceflow-txn-protocol".to_string();
        // (What the admin API shows of a transaction with partitions needs their transaction
        // buffers loaded; that registration works shows in the transactional send tests.)
        tcs.add_partitions(t, std::slice::from_ref(&topic))
            .await
            .expect("ADD_PARTITION_TO_TXN");
        tcs.add_subscriptions(t, &[(topic.clone(), "onceflow-txn-sub".into())])
            .await
            .expect("ADD_SUBSCRIPTION_TO_TXN");

        tcs.end(t, TxnEnd::Commit).await.expect("END_TXN commit");
        // Committed: the coordinator no longer has it open, and a second commit is refused.
        let again = tcs.end(t, TxnEnd::Commit).await.expect_err("ended already");
        assert!(
            matches!(again.kind(), ErrorKind::Aborted | ErrorKind::NotFound),
            "{again}"
        );

        let a = tcs.new_txn(Duration::from_secs(60)).await.expect("NEW_TXN");
        assert_ne!(a, t);
        tcs.end(a, TxnEnd::Abort).await.expect("END_TXN abort");
        let e = tcs
            .end(a, TxnEnd::Commit)
            .await
            .expect_err("aborted already");
        assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");
    }

    /// A transaction still open at its timeout is aborted by the coordinator: its commit is
    /// then an `Aborted` error.
    #[tokio::test]
    async fn a_transaction_past_its_timeout_cannot_commit() {
        let Some((url, admin)) = broker() else { return };
        let platform = crate::connect(&url).await.expect("connect");
        let tcs = platform.shared.coordinators().await.expect("coordinators");
        let t = tcs
            .new_txn(Duration::from_millis(1))
            .await
            .expect("NEW_TXN");
        // The coordinator's timeout tracker aborts it on its next tick.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while metadata(&admin, t)
            .await
            .is_some_and(|m| m["status"] == "OPEN")
        {
            assert!(
                std::time::Instant::now() < deadline,
                "still open after 60 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let e = tcs.end(t, TxnEnd::Commit).await.expect_err("timed out");
        assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");
        assert!(
            e.message().contains(&t.to_string()) || e.message().contains("Txn"),
            "{e}"
        );
    }
}
