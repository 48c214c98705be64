//! What a stream promises about an acknowledged write: storage, replicas, the server's sync
//! setting where a client can read it.

use std::time::Duration;

use async_nats::jetstream::stream::StorageType;
use onceflow_core::Result;

use crate::Shared;

/// The server's `sync_interval` ([sync_interval]): how often a file store forces its writes
/// to disk.
///
/// [sync_interval]: https://docs.nats.io/running-a-nats-service/configuration#jetstream
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerSync {
    /// `sync_interval: always`: every write is synced before it is acknowledged.
    Always,
    /// Writes are synced at least this often (server default 2 min); an acknowledged write
    /// can be lost if the machine (not only the server process) fails before then.
    Interval(Duration),
    /// Not readable from this client: the setting is only exposed by the server's monitoring
    /// endpoint (`/varz`, `jetstream.config.sync_interval` / `sync_always`) and the system
    /// account's `$SYS.REQ.SERVER.PING.VARZ`, which ordinary users cannot call.
    Unknown,
}

impl std::fmt::Display for ServerSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerSync::Always => f.write_str("always"),
            ServerSync::Interval(d) => write!(f, "{} ms", d.as_millis()),
            ServerSync::Unknown => f.write_str("unknown"),
        }
    }
}

/// What the stream of a topic promises about a write the server acknowledged
/// ([`crate::JetStreamPlatform::durability`]).
///
/// An acknowledged publish is durable against a machine failure only if the stream is
/// stored in files and the servers sync every write (`sync_interval: always`), or when
/// enough replicas hold it that the failure of one machine cannot lose it (replicas ≥ 3 and
/// the failure of machines is independent). Sources: [JetStream persistence],
/// [sync_interval].
///
/// [JetStream persistence]: https://docs.nats.io/nats-concepts/jetstream#persistent-and-consistent-distributed-storage
/// [sync_interval]: https://docs.nats.io/running-a-nats-service/configuration#jetstream
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurabilityReport {
    /// The topic (stream name).
    pub topic: String,
    /// `"file"` or `"memory"` (the stream's `storage`). A memory stream loses everything on
    /// a server restart.
    pub storage: &'static str,
    /// The stream's replica count (`num_replicas`, 1 on a single server).
    pub replicas: usize,
    /// The server's sync setting, as far as this client can read it.
    pub sync: ServerSync,
    /// `Some(true)`: an acknowledged write is synced to disk (file storage, `sync: always`);
    /// `Some(false)`: it is not (memory storage, or an interval); `None`: cannot be told
    /// from this client (file storage, sync setting unknown).
    pub durable_on_ack: Option<bool>,
    /// This call logged the `require_durable` warning (the first one for the topic on this
    /// connection).
    pub warned: bool,
}

impl DurabilityReport {
    /// Why an acknowledged write might not survive a crash, or `None` when it is durable on
    /// ack.
    pub fn risk(&self) -> Option<String> {
        match self.durable_on_ack {
            Some(true) => None,
            Some(false) if self.storage == "memory" => Some(format!(
                "stream '{}' keeps its messages in memory (storage=memory): a server restart \
                 loses them",
                self.topic
            )),
            Some(false) => Some(format!(
                "stream '{}' is on file storage with {} replica(s) and the server syncs writes \
                 every {} (sync_interval): an acknowledged write can be lost if the machine \
                 fails before then; set sync_interval: always on the server",
                self.topic, self.replicas, self.sync
            )),
            None => Some(format!(
                "stream '{}' is on file storage with {} replica(s) and the server's \
                 sync_interval cannot be read by this client: an acknowledged write is synced \
                 to disk only with sync_interval: always (server default: every 2 min); check \
                 the server's /varz (jetstream.config.sync_always)",
                self.topic, self.replicas
            )),
        }
    }
}

/// The server's sync setting, asked once per connection ([`ask_server_sync`]): a user
/// without the right gets no answer (or a permissions error) every time, and a server's
/// `sync_interval` changes only with a restart.
async fn server_sync(shared: &Shared) -> ServerSync {
    if let Some(known) = *shared.server_sync.lock() {
        return known;
    }
    let sync = ask_server_sync(shared).await;
    *shared.server_sync.lock() = Some(sync);
    sync
}

/// Asks the servers for their `VARZ` through the system account's request subject; `Unknown`
/// when nobody answers (ordinary accounts cannot call it) or the answer has no JetStream
/// config.
async fn ask_server_sync(shared: &Shared) -> ServerSync {
    let request = shared
        .client
        .request("$SYS.REQ.SERVER.PING.VARZ", bytes::Bytes::new());
    let Ok(Ok(reply)) = tokio::time::timeout(Duration::from_millis(500), request).await else {
        return ServerSync::Unknown;
    };
    let text = String::from_utf8_lossy(&reply.payload);
    if text.contains("\"sync_always\":true") {
        return ServerSync::Always;
    }
    match crate::consumer::json_num(&text, "sync_interval") {
        Some(ns) if ns > 0 => ServerSync::Interval(Duration::from_nanos(ns)),
        _ => ServerSync::Unknown,
    }
}

/// The durability report of `topic`'s stream.
pub(crate) async fn report(shared: &Shared, topic: &str) -> Result<DurabilityReport> {
    let stream = shared.get_stream(topic).await?;
    let c = &stream.cached_info().config;
    let memory = c.storage == StorageType::Memory;
    let sync = if memory {
        ServerSync::Unknown
    } else {
        server_sync(shared).await
    };
    let durable_on_ack = if memory {
        Some(false)
    } else {
        match sync {
            ServerSync::Always => Some(true),
            ServerSync::Interval(_) => Some(false),
            ServerSync::Unknown => None,
        }
    };
    Ok(DurabilityReport {
        topic: topic.to_string(),
        storage: if memory { "memory" } else { "file" },
        replicas: c.num_replicas,
        sync,
        durable_on_ack,
        warned: false,
    })
}
