//! A loopback HTTP/1.1 server for tests that need a small web service of their own (an OAuth 2.0
//! token endpoint, an OpenID discovery document): each connection carries one request, read
//! whole (head, then a body of `Content-Length` bytes), answered by the test's handler with a
//! status line and a JSON body, then closed.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One request as received: the head's text (request line and headers) and the body.
#[derive(Debug, Clone)]
pub struct Request {
    /// The request line and headers, CRLF-separated, without the blank line.
    pub head: String,
    /// The body, `Content-Length` bytes of it (lossy UTF-8).
    pub body: String,
}

impl Request {
    /// The request target of the request line, e.g. `/oauth2/token`.
    pub fn path(&self) -> &str {
        self.head.split_whitespace().nth(1).unwrap_or("/")
    }

    /// The value of header `name` (case-insensitive), trimmed.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Serves on `bind` (e.g. `127.0.0.1:0`) until the test ends; `handler` turns each request into
/// a status line's text (`"200 OK"`) and a JSON body. Returns the bound address.
pub async fn serve<F>(bind: &str, handler: F) -> std::net::SocketAddr
where
    F: Fn(&Request) -> (&'static str, String) + Send + Sync + 'static,
{
    let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handler = Arc::new(handler);
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let handler = handler.clone();
            tokio::spawn(async move {
                let Some(request) = read_request(&mut sock).await else {
                    return;
                };
                let (status, body) = handler(&request);
                let reply = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(reply.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    addr
}

/// Reads the head, then the body by `Content-Length`; `None` when the peer closes first.
async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<Request> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = sock.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        let request = Request {
            head,
            body: String::new(),
        };
        let length = request
            .header("content-length")
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        while buf.len() < end + 4 + length {
            let n = sock.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
            buf.extend_from_slice(&chunk[..n]);
        }
        return Some(Request {
            body: String::from_utf8_lossy(&buf[end + 4..end + 4 + length]).to_string(),
            ..request
        });
    }
}
