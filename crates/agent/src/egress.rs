//! The egress proxy of a `filtered` sandbox: an HTTP proxy on 127.0.0.1
//! inside the sandbox that decides nothing itself.
//!
//! Every client's `CONNECT host:port` (or absolute-form plain-HTTP request)
//! becomes an `EgressRequest` on the host's control connection. The host
//! checks its policy, resolves the name and connects; then it opens an
//! `egress_attach` connection that is spliced to the client, or answers
//! `EgressDeny`, which the client gets as HTTP 403 with the reason. The
//! sandbox never resolves or connects anything outside itself: its network
//! namespace has only loopback.
//!
//! Everything is bounded: the request head, clients waiting for a decision,
//! open tunnels, and the time a client may take to send its head or wait.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use moat_proto::{AgentMsg, ClientMsg, Connection, ErrorKind, Frame, Reply, WireError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::error::io_error;

/// The largest request head the proxy reads (request line and headers).
pub const MAX_HEAD: usize = 16 * 1024;
/// The most headers a request head may have.
const MAX_HEADERS: usize = 128;
/// Clients waiting for the host's decision at once; more get 503.
pub const MAX_PENDING: usize = 64;
/// Open tunnels (and clients waiting) at once; more get 503.
pub const MAX_TUNNELS: usize = 256;
/// How long a client may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client waits for the host's decision (the host's own connect
/// timeout is shorter).
const DECISION_TIMEOUT: Duration = Duration::from_secs(30);

/// A byte stream of any kind (the attach connection is generic).
pub trait RawStream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> RawStream for T {}

/// The host's answer for one client.
enum Decision {
    Attach(Box<dyn RawStream>),
    Deny(String),
}

/// Clients waiting for a decision, shared by the control connection and
/// the attach connections.
#[derive(Debug, Default)]
pub struct EgressHub {
    pending: std::sync::Mutex<HashMap<u64, oneshot::Sender<Decision>>>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Attach(_) => f.write_str("Attach"),
            Self::Deny(reason) => write!(f, "Deny({reason})"),
        }
    }
}

impl EgressHub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, oneshot::Sender<Decision>>> {
        // Each critical section is one map operation.
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn register(&self) -> Option<(u64, oneshot::Receiver<Decision>)> {
        let mut pending = self.lock();
        if pending.len() >= MAX_PENDING {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = oneshot::channel();
        pending.insert(id, tx);
        Some((id, rx))
    }

    fn take(&self, id: u64) -> Option<oneshot::Sender<Decision>> {
        self.lock().remove(&id)
    }
}

/// Serves an `egress_listen` connection: binds the proxy, reports each
/// client to the host, and applies the host's refusals, until the host
/// closes the connection (which stops the proxy).
pub async fn serve_listen<S>(hub: Arc<EgressHub>, port: u16, mut conn: Connection<S>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let listener = match bind(port).await {
        Ok(listener) => listener,
        Err(error) => {
            let _ = conn.send(&AgentMsg::Error { error }).await;
            return;
        }
    };
    if conn.send(&AgentMsg::Reply { reply: Reply::Listening { port } }).await.is_err() {
        return;
    }
    let (mut sink, mut stream) = conn.split();
    let (events, mut to_host) = mpsc::channel::<AgentMsg>(MAX_PENDING);
    let tunnels = Arc::new(Semaphore::new(MAX_TUNNELS));
    let mut clients = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                match tunnels.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let (hub, events) = (hub.clone(), events.clone());
                        clients.spawn(async move {
                            serve_client(&hub, client, &events).await;
                            drop(permit);
                        });
                    }
                    Err(_) => {
                        clients.spawn(refuse(client, 503, "Service Unavailable", format!(
                            "moat: more than {MAX_TUNNELS} connections through the sandbox's proxy at once; close some and retry"
                        )));
                    }
                }
            }
            Some(event) = to_host.recv() => {
                if sink.send(&event).await.is_err() {
                    break;
                }
            }
            frame = stream.recv() => match frame {
                Some(Ok(Frame::Message(body))) => {
                    if let Ok(ClientMsg::EgressDeny { id, reason }) = moat_proto::conn::decode_message(&body)
                        && let Some(waiting) = hub.take(id)
                    {
                        let _ = waiting.send(Decision::Deny(reason));
                    }
                }
                // The host is gone (or broke the protocol): stop the proxy.
                _ => break,
            },
            // Reap finished clients so that the set stays small.
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
        }
    }
    // Waiting clients learn that nobody will decide; tunnels end with the set.
    hub.lock().clear();
    clients.shutdown().await;
}

/// Serves an `egress_attach` connection: hands it to the waiting client.
pub async fn serve_attach<S>(hub: &EgressHub, id: u64, mut conn: Connection<S>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Some(waiting) = hub.take(id) else {
        let error = WireError::new(
            ErrorKind::NotFound,
            format!("no proxy client {id} is waiting (it gave up, was answered, or the proxy stopped)"),
        );
        let _ = conn.send(&AgentMsg::Error { error }).await;
        return;
    };
    if conn.send(&AgentMsg::Reply { reply: Reply::Connected }).await.is_err() {
        return;
    }
    let _ = waiting.send(Decision::Attach(Box::new(conn.into_raw())));
}

async fn bind(port: u16) -> Result<TcpListener, WireError> {
    if port == 0 {
        return Err(WireError::new(ErrorKind::InvalidRequest, "port 0 is not a port; allowed are 1 to 65535"));
    }
    TcpListener::bind(("127.0.0.1", port)).await.map_err(|e| io_error(&format!("binding 127.0.0.1:{port}"), &e))
}

/// What a client asked for.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    host: String,
    port: u16,
    /// For plain HTTP: the request head rewritten to origin form, sent
    /// upstream instead of answering 200.
    forward_head: Option<Vec<u8>>,
}

async fn serve_client(hub: &EgressHub, mut client: TcpStream, events: &mpsc::Sender<AgentMsg>) {
    let (head, rest) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut client)).await {
        Ok(Ok(read)) => read,
        Ok(Err(why)) => return refuse(client, 400, "Bad Request", why).await,
        Err(_) => return refuse(client, 408, "Request Timeout", "moat: no request head within 10 s".into()).await,
    };
    let target = match parse_head(&head) {
        Ok(target) => target,
        Err(why) => return refuse(client, 400, "Bad Request", why).await,
    };
    let Some((id, decision)) = hub.register() else {
        let why = format!("moat: more than {MAX_PENDING} proxy clients wait for a decision; retry");
        return refuse(client, 503, "Service Unavailable", why).await;
    };
    let event = AgentMsg::EgressRequest { id, host: target.host.clone(), port: target.port };
    if events.send(event).await.is_err() {
        hub.take(id);
        return refuse(client, 503, "Service Unavailable", "moat: the egress proxy is stopping".into()).await;
    }
    let decision = match tokio::time::timeout(DECISION_TIMEOUT, decision).await {
        Ok(Ok(decision)) => decision,
        Ok(Err(_)) => {
            return refuse(client, 502, "Bad Gateway", "moat: the host stopped the egress proxy".into()).await;
        }
        Err(_) => {
            hub.take(id);
            let why = format!("moat: no answer for {}:{} within 30 s", target.host, target.port);
            return refuse(client, 504, "Gateway Timeout", why).await;
        }
    };
    let mut upstream = match decision {
        Decision::Attach(upstream) => upstream,
        Decision::Deny(reason) => {
            // The reason goes in the status line too: clients that show only
            // that (pip, git, curl) still tell the user why.
            let phrase = phrase_of(&reason);
            return refuse(client, 403, &phrase, reason).await;
        }
    };
    let started = match &target.forward_head {
        None => client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await,
        Some(head) => upstream.write_all(head).await,
    };
    if started.is_err() || upstream.write_all(&rest).await.is_err() {
        return;
    }
    if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        tracing::debug!(host = target.host, "egress tunnel ended: {e}");
    }
}

/// Reads up to the end of the request head; returns the head and any bytes
/// read past it.
async fn read_head(client: &mut TcpStream) -> Result<(Vec<u8>, Vec<u8>), String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let too_long = || format!("moat: the request head is longer than {MAX_HEAD} bytes");
    loop {
        let n = client.read(&mut chunk).await.map_err(|e| format!("moat: reading the request failed: {e}"))?;
        if n == 0 {
            return Err("moat: the connection closed before a complete request head".into());
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        match parse_request(&mut httparse::Request::new(&mut headers), &buf)? {
            Some(end) if end > MAX_HEAD => return Err(too_long()),
            Some(end) => {
                let rest = buf.split_off(end);
                return Ok((buf, rest));
            }
            None if buf.len() >= MAX_HEAD => return Err(too_long()),
            None => {}
        }
    }
}

/// Parses the request head at the start of `buf` into `request`: its
/// length through its blank line, or `None` while it is not complete. A
/// line that is no header (an obsolete folded continuation, say) is
/// dropped.
fn parse_request<'b>(request: &mut httparse::Request<'_, 'b>, buf: &'b [u8]) -> Result<Option<usize>, String> {
    let mut config = httparse::ParserConfig::default();
    config.ignore_invalid_headers_in_requests(true);
    match config.parse_request(request, buf) {
        Ok(httparse::Status::Complete(len)) => Ok(Some(len)),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::Version) => Err("moat: unsupported HTTP version; send HTTP/1.0 or HTTP/1.1".into()),
        Err(httparse::Error::TooManyHeaders) => Err(format!("moat: more than {MAX_HEADERS} request headers")),
        Err(httparse::Error::Token | httparse::Error::NewLine) => {
            let line = buf.split(|b| *b == b'\n').next().unwrap_or_default();
            Err(format!("moat: not an HTTP request line: {:?}", clip(&String::from_utf8_lossy(line))))
        }
        Err(e) => Err(format!("moat: a malformed request head ({e})")),
    }
}

/// Understands `CONNECT host:port HTTP/1.x` and absolute-form plain-HTTP
/// requests (`GET http://host[:port]/path HTTP/1.x`).
fn parse_head(head: &[u8]) -> Result<Target, String> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    let complete = parse_request(&mut request, head)?;
    let (Some(_), Some(method), Some(target), Some(version)) =
        (complete, request.method, request.path, request.version)
    else {
        return Err("moat: the request head is not complete".into());
    };
    if method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = split_host_port(target, None)?;
        return Ok(Target { host, port, forward_head: None });
    }
    let Some(rest) = target.strip_prefix("http://") else {
        return Err(format!(
            "moat: this is a proxy; send CONNECT host:port (https) or an absolute http:// URL, not {:?}",
            clip(target)
        ));
    };
    let (authority, path) = rest.find('/').map_or((rest, "/"), |i| (&rest[..i], &rest[i..]));
    let (host, port) = split_host_port(authority, Some(80))?;
    let mut forward_head = format!("{method} {path} HTTP/1.{version}\r\n");
    for header in request.headers.iter() {
        let value = std::str::from_utf8(header.value).map_err(|_| "moat: the request head is not UTF-8".to_owned())?;
        forward_head.push_str(&format!("{}: {value}\r\n", header.name));
    }
    forward_head.push_str("\r\n");
    Ok(Target { host, port, forward_head: Some(forward_head.into_bytes()) })
}

fn split_host_port(authority: &str, default_port: Option<u16>) -> Result<(String, u16), String> {
    let bad = || format!("moat: {:?} is not host:port", clip(authority));
    if authority.contains('@') {
        return Err(bad());
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or_else(bad)?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    let port = match (port, default_port) {
        (Some(port), _) => port.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(bad)?,
        (None, Some(default)) => default,
        (None, None) => return Err(bad()),
    };
    let host_ok = |c: char| c.is_ascii_alphanumeric() || ".-_:".contains(c);
    if host.is_empty() || host.len() > 253 || !host.chars().all(host_ok) {
        return Err(bad());
    }
    Ok((host.to_ascii_lowercase(), port))
}

/// A reason made fit for a status line: its first line, printable ASCII.
fn phrase_of(reason: &str) -> String {
    let first = reason.lines().next().unwrap_or_default();
    let phrase: String =
        first.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).take(200).collect();
    if phrase.trim().is_empty() { "Forbidden".into() } else { phrase }
}

fn clip(s: &str) -> String {
    s.chars().take(200).collect()
}

/// Answers the client with an error status and `body`, then closes.
async fn refuse(mut client: TcpStream, status: u16, phrase: &str, body: String) {
    let body = format!("{body}\n");
    let response = format!(
        "HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\
         X-Moat-Egress: refused\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = client.write_all(response.as_bytes()).await;
    let _ = client.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_and_absolute_requests_parse() {
        let t = parse_head(b"CONNECT PyPI.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n").expect("parses");
        assert_eq!((t.host.as_str(), t.port, t.forward_head), ("pypi.org", 443, None));
        let t = parse_head(b"CONNECT [::1]:8443 HTTP/1.1\r\n\r\n").expect("v6");
        assert_eq!((t.host.as_str(), t.port), ("::1", 8443));
        let t = parse_head(b"GET http://example.com:8080/a?b HTTP/1.1\r\nHost: example.com\r\n\r\n").expect("plain");
        assert_eq!((t.host.as_str(), t.port), ("example.com", 8080));
        assert_eq!(t.forward_head.as_deref(), Some(&b"GET /a?b HTTP/1.1\r\nHost: example.com\r\n\r\n"[..]));
        let t = parse_head(b"GET http://example.com HTTP/1.0\r\n\r\n").expect("no path");
        assert_eq!((t.port, t.forward_head.as_deref()), (80, Some(&b"GET / HTTP/1.0\r\n\r\n"[..])));
    }

    #[test]
    fn bad_requests_are_refused_with_a_reason() {
        for bad in [
            &b"GET / HTTP/1.1\r\n\r\n"[..],
            b"CONNECT pypi.org HTTP/1.1\r\n\r\n",
            b"CONNECT pypi.org:0 HTTP/1.1\r\n\r\n",
            b"CONNECT user@pypi.org:443 HTTP/1.1\r\n\r\n",
            b"CONNECT a b:443 HTTP/1.1\r\n\r\n",
            b"CONNECT pypi.org:443 SPDY/3\r\n\r\n",
            b"\xff\xfe\r\n\r\n",
        ] {
            let err = parse_head(bad).expect_err(&String::from_utf8_lossy(bad));
            assert!(err.starts_with("moat: "), "{err}");
        }
    }

    #[test]
    fn the_hub_is_bounded() {
        let hub = EgressHub::default();
        let held: Vec<_> = (0..MAX_PENDING).map(|_| hub.register().expect("room")).collect();
        assert!(hub.register().is_none(), "no room beyond MAX_PENDING");
        assert!(hub.take(held[0].0).is_some());
        assert!(hub.register().is_some(), "room again");
    }

    #[test]
    fn heads_parse_whatever_their_line_endings_and_drop_folded_lines() {
        let t =
            parse_head(b"GET http://example.com/ HTTP/1.1\nHost: example.com\n folded\nAccept:*/*\n\n").expect("LF");
        assert_eq!(t.forward_head.as_deref(), Some(&b"GET / HTTP/1.1\r\nHost: example.com\r\nAccept: */*\r\n\r\n"[..]));
        let many = format!("CONNECT a.b:443 HTTP/1.1\r\n{}\r\n", "A: b\r\n".repeat(MAX_HEADERS + 1));
        assert!(parse_head(many.as_bytes()).expect_err("too many").contains("headers"));
        let err = parse_head(b"GET http://a.b/ HTTP/1.1\r\nX: \xff\r\n\r\n").expect_err("not UTF-8");
        assert!(err.contains("UTF-8"), "{err}");
    }

    #[tokio::test]
    async fn a_head_is_read_across_reads_up_to_its_limit() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().expect("address");
        let send = |parts: Vec<Vec<u8>>| async move {
            let mut client = TcpStream::connect(addr).await.expect("connects");
            for part in parts {
                client.write_all(&part).await.expect("sends");
                client.flush().await.expect("flushes");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            client
        };
        let sent =
            tokio::spawn(send(vec![b"CONNECT a.b:443 HTTP/1.1\r\nHo".to_vec(), b"st: a.b\r\n\r\nhello".to_vec()]));
        let (mut server, _) = listener.accept().await.expect("accepts");
        let (head, rest) = read_head(&mut server).await.expect("a head");
        assert_eq!(
            (head.as_slice(), rest.as_slice()),
            (&b"CONNECT a.b:443 HTTP/1.1\r\nHost: a.b\r\n\r\n"[..], &b"hello"[..])
        );
        drop(sent.await);
        let start = "CONNECT a.b:443 HTTP/1.1\r\nX-Pad: ";
        for (len, fits) in [(MAX_HEAD, true), (MAX_HEAD + 1, false)] {
            let head = format!("{start}{}\r\n\r\n", "a".repeat(len - start.len() - 4));
            let sent = tokio::spawn(send(vec![head.into_bytes()]));
            let (mut server, _) = listener.accept().await.expect("accepts");
            let read = read_head(&mut server).await;
            assert_eq!(read.is_ok(), fits, "{len} bytes: {:?}", read.err());
            drop(sent.await);
        }
    }
}
