//! Network checks shared by the adapters whose native client hides an unreachable broker.
//!
//! A Kafka client contacts no broker until its first call and then waits out its request
//! timeouts (a minute and more) without a word; the Pulsar client retries a refused connection
//! for about 40 s. Adapters call [`check_reachable`] when they connect, so a wrong address or a
//! stopped broker is an immediate [`ErrorKind::Connect`] naming every address tried.

use std::time::Duration;

use crate::error::{redact_credentials, Error, ErrorKind, Result};

/// How long [`check_reachable`] waits for the TCP connection to each server by default.
pub const REACH_TIMEOUT: Duration = Duration::from_secs(5);

/// `Ok` as soon as one of `servers` (`HOST:PORT`, tried in order) accepts a TCP connection
/// within `timeout`; the connection is closed at once.
///
/// Errors: [`ErrorKind::Connect`] when none does, naming each server (credentials removed) and
/// why it failed (`Connection refused`, a name that does not resolve, no answer within the
/// timeout); [`ErrorKind::Config`] when `servers` is empty. `platform` (`Kafka`, `Pulsar`) only
/// words the message.
pub async fn check_reachable(platform: &str, servers: &[&str], timeout: Duration) -> Result<()> {
    if servers.is_empty() {
        return Err(Error::config(format!(
            "no {platform} broker address given: expected HOST:PORT[,HOST:PORT…]"
        )));
    }
    let mut failures = Vec::with_capacity(servers.len());
    for server in servers {
        match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(server)).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => failures.push(format!("{}: {e}", redact_credentials(server))),
            Err(_) => failures.push(format!(
                "{}: no answer within {} ms",
                redact_credentials(server),
                timeout.as_millis()
            )),
        }
    }
    Err(Error::new(
        ErrorKind::Connect,
        format!(
            "no {platform} broker is reachable ({}); check the URL and that the broker is \
             running",
            failures.join("; ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_listening_server_is_reachable() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        check_reachable("Kafka", &["127.0.0.1:1", &addr], REACH_TIMEOUT)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn refused_servers_are_each_named() {
        // Bind then drop: the port is free and refuses connections.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let a = format!("127.0.0.1:{port}");
        let e = check_reachable("Pulsar", &[&a, "127.0.0.1:1"], REACH_TIMEOUT)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Connect);
        assert!(e.message().contains(&a), "{e}");
        assert!(e.message().contains("127.0.0.1:1"), "{e}");
        assert!(
            e.message().starts_with("no Pulsar broker is reachable"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn no_server_is_bad_input() {
        let e = check_reachable("Kafka", &[], REACH_TIMEOUT)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
    }
}
