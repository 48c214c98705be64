//! Shards as onceflow partitions, and AWS errors as onceflow errors.

use aws_sdk_kinesis::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_kinesis::types::Shard;
use aws_sdk_kinesis::Client;
use onceflow_core::{Error, ErrorKind, Result};

/// The partition number of a shard: the number after the last `-` of its id
/// (`shardId-000000000003` → 3). Kinesis numbers shards of a stream from 0 and gives every
/// shard created by a split or merge the next number, never reusing one, so the mapping is
/// stable for the life of the stream. `None` for an id without a numeric suffix.
pub fn partition_of_shard(shard_id: &str) -> Option<i32> {
    shard_id
        .rsplit('-')
        .next()
        .and_then(|n| n.parse::<i64>().ok())
        .and_then(|n| i32::try_from(n).ok())
}

/// The shard id of partition `p`: `shardId-` and `p` in 12 digits (the form Kinesis uses).
pub fn shard_of_partition(p: i32) -> String {
    format!("shardId-{p:012}")
}

/// A shard as listed by ListShards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    /// Shard id.
    pub id: String,
    /// Partition number ([`partition_of_shard`]).
    pub partition: i32,
    /// Parent shard ids (split: one; merge: two).
    pub parents: Vec<String>,
    /// First hash key (decimal, 0..2^128-1).
    pub starting_hash_key: String,
    /// Whether the shard is closed (has an ending sequence number).
    pub closed: bool,
}

impl ShardInfo {
    pub(crate) fn from_sdk(s: &Shard) -> Option<ShardInfo> {
        let id = s.shard_id().to_string();
        let partition = partition_of_shard(&id)?;
        let parents = s
            .parent_shard_id()
            .into_iter()
            .chain(s.adjacent_parent_shard_id())
            .map(String::from)
            .collect();
        Some(ShardInfo {
            partition,
            parents,
            starting_hash_key: s
                .hash_key_range()
                .map(|r| r.starting_hash_key().to_string())
                .unwrap_or_default(),
            closed: s
                .sequence_number_range()
                .and_then(|r| r.ending_sequence_number())
                .is_some(),
            id,
        })
    }
}

/// Every shard of `stream` (open and closed, still retained), by partition.
pub(crate) async fn list_shards(client: &Client, stream: &str) -> Result<Vec<ShardInfo>> {
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let req = match &token {
            Some(t) => client.list_shards().next_token(t),
            None => client.list_shards().stream_name(stream),
        };
        let resp = req
            .send()
            .await
            .map_err(|e| aws_err(format!("ListShards of stream '{stream}'"), e))?;
        out.extend(resp.shards().iter().filter_map(ShardInfo::from_sdk));
        match resp.next_token() {
            Some(t) if !t.is_empty() => token = Some(t.to_string()),
            _ => break,
        }
    }
    out.sort_by_key(|s| s.partition);
    Ok(out)
}

/// Maps an AWS SDK error to onceflow's: the service's error code and message (never the
/// request, so never a credential), the kind by code, retriable for throttling.
pub(crate) fn aws_err<E, R>(what: impl Into<String>, e: SdkError<E, R>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let what = what.into();
    if let Some(ce) = crate::credentials::find_credentials_error(&e) {
        return crate::credentials::auth_error(&what, ce);
    }
    match e {
        SdkError::ServiceError(se) => {
            let err = se.into_err();
            let code = err.code().unwrap_or("Unknown").to_string();
            let msg = err.message().unwrap_or("").to_string();
            let (kind, retriable) = match code.as_str() {
                "ResourceNotFoundException" => (ErrorKind::NotFound, false),
                "InvalidArgumentException" | "ValidationException" => (ErrorKind::Config, false),
                "ProvisionedThroughputExceededException"
                | "LimitExceededException"
                | "ThrottlingException"
                | "KMSThrottlingException"
                | "InternalFailure"
                | "InternalFailureException"
                | "ServiceUnavailable" => (ErrorKind::Platform, true),
                "ExpiredIteratorException" | "ExpiredNextTokenException" => {
                    (ErrorKind::Platform, true)
                }
                "UnrecognizedClientException"
                | "AccessDeniedException"
                | "MissingAuthenticationToken"
                | "IncompleteSignatureException"
                | "InvalidSignatureException"
                | "ExpiredTokenException"
                | "InvalidClientTokenId"
                | "SignatureDoesNotMatch" => (ErrorKind::Auth, false),
                _ => (ErrorKind::Platform, false),
            };
            Error::new(kind, format!("Kinesis {what}: {code}: {msg}"))
                .with_source(err)
                .retriable(retriable)
        }
        SdkError::TimeoutError(_) => Error::new(
            ErrorKind::Timeout,
            format!(
                "Kinesis {what}: no answer within the operation timeout (URL option \
                 timeout_ms, default 10000)"
            ),
        )
        .with_outcome_unknown(),
        SdkError::DispatchFailure(d) => {
            let msg = if d.is_io() {
                "cannot reach the endpoint (connection failed)"
            } else if d.is_timeout() {
                "connection timed out"
            } else {
                "request could not be sent"
            };
            Error::new(ErrorKind::Connect, format!("Kinesis {what}: {msg}"))
        }
        other => Error::new(
            ErrorKind::Platform,
            format!("Kinesis {what}: {}", error_chain(&other)),
        )
        .retriable(true),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_partition_mapping() {
        assert_eq!(partition_of_shard("shardId-000000000003"), Some(3));
        assert_eq!(partition_of_shard("shardId-000000000000"), Some(0));
        assert_eq!(partition_of_shard("nope"), None);
        assert_eq!(shard_of_partition(12), "shardId-000000000012");
    }
}
