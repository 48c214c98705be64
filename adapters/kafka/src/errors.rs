//! Mapping of librdkafka errors onto onceflow's [`ErrorKind`]s. The native error stays the
//! `source()`; rdkafka types never appear in the public API.

use onceflow_core::{Error, ErrorKind};
use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};

/// Codes meaning "this producer or group member lost its right to act" (KIP-98 producer
/// epochs, KIP-447 consumer-group fencing of transactional offset commits).
pub(crate) fn is_fencing(code: C) -> bool {
    is_group_fencing(code)
        || matches!(
            code,
            C::Fenced
                | C::ProducerFenced
                | C::InvalidProducerEpoch
                | C::InvalidProducerIdMapping
                | C::TransactionalIdAuthorizationFailed
        )
}

/// Codes of KIP-447 group fencing: the group's generation moved on (a rebalance, or this
/// member was removed), so positions read in the old generation cannot commit. The producer is
/// not fenced: once the transaction is aborted, the member goes on from the committed
/// positions after it rejoins (what Kafka Streams does on `TaskMigratedException`).
pub(crate) fn is_group_fencing(code: C) -> bool {
    matches!(
        code,
        C::IllegalGeneration | C::UnknownMemberId | C::FencedInstanceId | C::RebalanceInProgress
    )
}

fn is_timeout(code: C) -> bool {
    matches!(
        code,
        C::OperationTimedOut | C::RequestTimedOut | C::MessageTimedOut
    )
}

fn is_connect(code: C) -> bool {
    matches!(
        code,
        C::BrokerTransportFailure | C::AllBrokersDown | C::Resolve | C::NetworkException
    )
}

/// Codes of a refusal of who we are or what we may do: SASL authentication failed (KIP-152's
/// SaslAuthenticate error, librdkafka's local `_AUTHENTICATION`), the TLS handshake failed
/// (untrusted or mismatched certificate: `_SSL`), a mechanism the listener does not enable, or
/// an ACL denying the topic, group or cluster. The transactional id's refusal stays with
/// [`is_fencing`] (it ends the producer the same way).
pub(crate) fn is_auth(code: C) -> bool {
    matches!(
        code,
        C::Authentication
            | C::SSL
            | C::SaslAuthenticationFailed
            | C::UnsupportedSASLMechanism
            | C::IllegalSASLState
            | C::TopicAuthorizationFailed
            | C::GroupAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::SecurityDisabled
            | C::DelegationTokenExpired
            | C::DelegationTokenAuthorizationFailed
    )
}

fn is_not_found(code: C) -> bool {
    matches!(
        code,
        C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition
    )
}

/// Maps an rdkafka error; `what` names the operation and the value at fault.
pub(crate) fn map(err: KafkaError, what: impl std::fmt::Display) -> Error {
    let message = format!("{what}: {err}");
    let e = match &err {
        KafkaError::Transaction(t) => {
            let code = t.code();
            if is_group_fencing(code) {
                // Retriable: the transaction is lost, not the producer (see is_group_fencing).
                Error::new(
                    ErrorKind::Fenced,
                    format!(
                        "{message} (group fencing, KIP-447: the group's generation moved on; the \
                         transaction is aborted and its inputs are read again)"
                    ),
                )
                .retriable(true)
            } else if is_fencing(code) {
                Error::new(ErrorKind::Fenced, message).retriable(false)
            } else if t.txn_requires_abort() {
                Error::new(
                    ErrorKind::Aborted,
                    format!("{message} (the transaction must be aborted)"),
                )
                .retriable(false)
            } else if is_timeout(code) {
                Error::new(ErrorKind::Timeout, message).retriable(t.is_retriable())
            } else if t.is_fatal() {
                Error::new(ErrorKind::Platform, format!("{message} (fatal)")).retriable(false)
            } else {
                Error::new(ErrorKind::Platform, message).retriable(t.is_retriable())
            }
        }
        KafkaError::ClientConfig(_, desc, key, _) => {
            // The value is never shown (a mistyped `sasl.pasword` is still a secret), nor is
            // the native error, whose text repeats it.
            let desc = if onceflow_core::is_secret_key(key) {
                " (value not shown)".to_string()
            } else {
                format!(": {desc}")
            };
            return Error::new(
                ErrorKind::Config,
                format!(
                    "{what}: librdkafka refused property '{key}'{desc} (URL \
                     query parameters and options are librdkafka properties: \
                     https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md)"
                ),
            );
        }
        KafkaError::ClientCreation(reason) => Error::new(
            ErrorKind::Config,
            format!("{what}: librdkafka cannot make a client of these settings: {reason}"),
        ),
        KafkaError::Canceled => Error::new(ErrorKind::Closed, message),
        other => match other.rdkafka_error_code() {
            // onceflow checks what librdkafka checks before a record is sent, so a size refusal
            // here is the broker's: the topic's `max.message.bytes` (the broker's
            // `message.max.bytes` unless set) is below the producer's.
            Some(C::MessageSizeTooLarge) => Error::new(
                ErrorKind::Config,
                format!(
                    "{message}: the broker refused the record batch as larger than the topic's \
                     max.message.bytes (default: the broker's message.max.bytes, {}): expected \
                     records within it, or the topic's max.message.bytes raised to the \
                     producer's message.max.bytes",
                    crate::BROKER_DEFAULT_MESSAGE_MAX_BYTES
                ),
            ),
            Some(C::InvalidRecord) => Error::new(ErrorKind::Config, message),
            Some(code) if is_fencing(code) => Error::new(ErrorKind::Fenced, message),
            Some(code) if is_auth(code) => Error::new(ErrorKind::Auth, message),
            Some(code) if is_timeout(code) => Error::new(ErrorKind::Timeout, message),
            Some(code) if is_connect(code) => Error::new(ErrorKind::Connect, message),
            Some(code) if is_not_found(code) => Error::new(ErrorKind::NotFound, message),
            Some(C::TopicAlreadyExists) => Error::new(ErrorKind::Config, message),
            Some(
                C::NotEnoughReplicas
                | C::NotEnoughReplicasAfterAppend
                | C::LeaderNotAvailable
                | C::NotLeaderForPartition
                | C::CoordinatorNotAvailable
                | C::NotCoordinator
                | C::CoordinatorLoadInProgress
                | C::QueueFull,
            ) => Error::new(ErrorKind::Platform, message).retriable(true),
            _ => Error::new(ErrorKind::Platform, message),
        },
    };
    e.with_source(err)
}

/// The error of a blocking task that panicked or was cancelled.
pub(crate) fn join(err: tokio::task::JoinError, what: &str) -> Error {
    Error::new(
        ErrorKind::Platform,
        format!("{what}: blocking task failed: {err}"),
    )
}
