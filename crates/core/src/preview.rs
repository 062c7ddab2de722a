//! Preview links: a listener on the host's loopback that forwards each
//! connection to one port inside one sandbox, through the agent's
//! `port_forward`, for whoever holds the link's token.
//!
//! A browser opens `http://127.0.0.1:<listener>/?moat_token=<token>`; the
//! link answers with a redirect that drops the token from the address and
//! sets it as a cookie named after the listener's port (cookies ignore
//! ports, so each link has its own name). Later requests carry the cookie.
//! After the first request head of a connection is checked, bytes flow
//! unchanged both ways, so HTTP keep-alive and WebSocket upgrades work.
//! Each link has its own token, valid for its own port only; the listener
//! and every connection through it end with the sandbox.

use std::sync::Arc;
use std::time::Duration;

use moat_proto::{AgentClient, UnixConnector};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::error::CoreError;

/// The largest first request head a link reads.
const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send its first request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections one link carries at once.
const MAX_CONNECTIONS: usize = 64;
/// The query parameter that carries the token.
pub const TOKEN_PARAM: &str = "moat_token";

/// Opens a client of the sandbox's agent (resuming it if suspended).
pub type Connect = Arc<dyn Fn() -> Result<AgentClient<UnixConnector>, CoreError> + Send + Sync>;

/// What a caller gets: where to point a browser.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreviewLink {
    /// The URL with the token, ready for a browser.
    pub url: String,
    /// The port inside the sandbox.
    pub port: u16,
    pub token: String,
    /// The port of the listener on 127.0.0.1.
    pub host_port: u16,
    /// Seconds since the Unix epoch: when the sandbox (and the link) ends.
    pub expires_at: u64,
}

/// A live link; dropping it closes the listener and its connections.
#[derive(Debug)]
pub struct Preview {
    link: PreviewLink,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Preview {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Preview {
    pub async fn start(port: u16, expires_at: u64, connect: Connect) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let host_port = listener.local_addr()?.port();
        let token = new_token()?;
        let link = PreviewLink {
            url: format!("http://127.0.0.1:{host_port}/?{TOKEN_PARAM}={token}"),
            port,
            token: token.clone(),
            host_port,
            expires_at,
        };
        let guard = Arc::new(Guard { token, cookie: format!("moat_preview_{host_port}"), port });
        let task = tokio::spawn(serve(listener, guard, connect));
        Ok(Self { link, task })
    }

    pub fn link(&self) -> PreviewLink {
        self.link.clone()
    }
}

struct Guard {
    token: String,
    cookie: String,
    port: u16,
}

async fn serve(listener: TcpListener, guard: Arc<Guard>, connect: Connect) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    connections.spawn(answer(stream, "503 Service Unavailable", "Too many connections through this preview link.".into(), None));
                    continue;
                };
                let (guard, connect) = (guard.clone(), connect.clone());
                connections.spawn(async move {
                    connection(stream, &guard, &connect).await;
                    drop(permit);
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// What the first request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// The token is in the query: set the cookie and redirect here.
    Redirect(String),
    /// The cookie is right: forward.
    Forward,
    Refuse(&'static str),
}

fn judge(head: &str, guard: &Guard) -> Verdict {
    let line = head.lines().next().unwrap_or_default();
    let mut words = line.split(' ');
    let (Some(_method), Some(target)) = (words.next(), words.next()) else {
        return Verdict::Refuse("not an HTTP request");
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut kept = Vec::new();
    let mut from_query = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.strip_prefix(TOKEN_PARAM).and_then(|v| v.strip_prefix('=')) {
            Some(value) => from_query = Some(value),
            None => kept.push(pair),
        }
    }
    if let Some(value) = from_query {
        if !same(value, &guard.token) {
            return Verdict::Refuse("the token in the address is not this link's");
        }
        let location = if kept.is_empty() { path.to_owned() } else { format!("{path}?{}", kept.join("&")) };
        return Verdict::Redirect(if location.starts_with('/') { location } else { "/".into() });
    }
    let cookie = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .filter(|(name, _)| name.trim().eq_ignore_ascii_case("cookie"))
        .flat_map(|(_, value)| value.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(name, _)| *name == guard.cookie);
    match cookie {
        Some((_, value)) if same(value, &guard.token) => Verdict::Forward,
        Some(_) => Verdict::Refuse("the cookie holds another token"),
        None => Verdict::Refuse("no token: open the link's full URL (with ?moat_token=…) first"),
    }
}

/// Compares without stopping at the first difference.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn connection(mut stream: TcpStream, guard: &Guard, connect: &Connect) {
    let (head, rest) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await {
        Ok(Some(read)) => read,
        _ => return answer(stream, "400 Bad Request", "No complete request head.".into(), None).await,
    };
    let text = String::from_utf8_lossy(&head).into_owned();
    match judge(&text, guard) {
        Verdict::Refuse(why) => {
            let body = format!("moat preview link for sandbox port {}: refused: {why}.", guard.port);
            answer(stream, "403 Forbidden", body, None).await;
        }
        Verdict::Redirect(location) => {
            let headers = format!(
                "Location: {location}\r\nSet-Cookie: {}={}; Path=/; HttpOnly; SameSite=Strict\r\n",
                guard.cookie, guard.token
            );
            answer(stream, "303 See Other", "Redirecting.".into(), Some(headers)).await;
        }
        Verdict::Forward => {
            let upstream = match connect() {
                Ok(client) => client.port_forward(guard.port).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let mut upstream = match upstream {
                Ok(upstream) => upstream,
                Err(why) => return answer(stream, "502 Bad Gateway", why, None).await,
            };
            if upstream.write_all(&head).await.is_err() || upstream.write_all(&rest).await.is_err() {
                return;
            }
            let _ = tokio::io::copy_bidirectional(&mut stream, &mut upstream).await;
        }
    }
}

async fn read_head(stream: &mut TcpStream) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(from + end + 4);
            return Some((buf, rest));
        }
        if buf.len() > MAX_HEAD {
            return None;
        }
    }
}

async fn answer(mut stream: TcpStream, status: &str, body: String, headers: Option<String>) {
    let body = format!("{body}\n");
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n{body}",
        body.len(),
        headers.unwrap_or_default()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// 32 random hex digits.
fn new_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> Guard {
        Guard { token: "a".repeat(32), cookie: "moat_preview_4000".into(), port: 8000 }
    }

    #[test]
    fn the_token_is_required_first_in_the_address_then_as_a_cookie() {
        let token = "a".repeat(32);
        let g = guard();
        assert_eq!(
            judge(&format!("GET /app?x=1&moat_token={token} HTTP/1.1\r\n\r\n"), &g),
            Verdict::Redirect("/app?x=1".into())
        );
        assert_eq!(judge(&format!("GET /?moat_token={token} HTTP/1.1\r\n\r\n"), &g), Verdict::Redirect("/".into()));
        assert_eq!(
            judge(&format!("GET /x HTTP/1.1\r\nCookie: a=b; moat_preview_4000={token}\r\n\r\n"), &g),
            Verdict::Forward
        );
        assert!(matches!(judge("GET / HTTP/1.1\r\n\r\n", &g), Verdict::Refuse(_)));
        assert!(matches!(judge("GET /?moat_token=bbbb HTTP/1.1\r\n\r\n", &g), Verdict::Refuse(_)));
        let other_link = format!("GET / HTTP/1.1\r\nCookie: moat_preview_4001={token}\r\n\r\n");
        assert!(matches!(judge(&other_link, &g), Verdict::Refuse(_)), "another link's cookie does not count");
        let wrong = format!("GET / HTTP/1.1\r\nCookie: moat_preview_4000={}\r\n\r\n", "b".repeat(32));
        assert!(matches!(judge(&wrong, &g), Verdict::Refuse(_)));
    }
}
