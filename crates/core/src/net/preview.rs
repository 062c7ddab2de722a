//! Preview links: a listener on the host's loopback that forwards each
//! connection to one port inside one sandbox, through the agent's
//! `port_forward`, for whoever holds the link's token.
//!
//! A browser opens `http://127.0.0.1:<listener>/?moat_token=<token>`; the
//! link answers with a redirect that drops the token from the address and
//! sets it as a cookie named after the listener's port (cookies ignore
//! ports, so each link has its own name). Later requests carry the cookie.
//! Each link has its own token, valid for its own port only; the listener
//! and every connection through it end with the sandbox.
//!
//! Every request head on a connection is checked and cleaned, not only the
//! first (keep-alive would otherwise carry later heads through unseen):
//!
//! - its cookie must be this link's, and it must come from this link's own
//!   pages: a browser's `Sec-Fetch-Site` must be `same-origin` or `none`,
//!   and an `Origin` this link's own, so a page served through another
//!   link (all links share the site 127.0.0.1) cannot use this one;
//! - what goes into the sandbox carries no `moat_*` cookie (no link's
//!   token), no `X-Moat-*` header and no `Authorization` holding a secret
//!   of the host ([`never_forward`], such as moat-mcp's HTTP token).
//!
//! Request bodies are forwarded by `Content-Length`; a chunked request body
//! is refused (411). After a WebSocket upgrade request, bytes flow
//! unchanged both ways.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use moat_proto::{AgentClient, UnixConnector};
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::error::SandboxError;

/// The largest request head a link reads.
const MAX_HEAD: usize = 16 * 1024;
/// The most headers a request head may have.
const MAX_HEADERS: usize = 128;
/// How long a client may take to send its first request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections one link carries at once.
const MAX_CONNECTIONS: usize = 64;
/// The query parameter that carries the token.
pub const TOKEN_PARAM: &str = "moat_token";

/// Secrets of the host side that no preview link forwards into a sandbox.
static NEVER_FORWARD: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Keeps `secret` (moat-mcp's HTTP token, say) out of every request a
/// preview link forwards: an `Authorization` header holding it is dropped.
pub fn never_forward(secret: &str) {
    if secret.len() >= 8 {
        NEVER_FORWARD.lock().unwrap_or_else(PoisonError::into_inner).push(secret.to_owned());
    }
}

/// Opens a client of the sandbox's agent (resuming it if suspended).
pub type Connect = Arc<dyn Fn() -> Result<AgentClient<UnixConnector>, SandboxError> + Send + Sync>;

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
        let guard = Arc::new(Guard {
            token,
            cookie: format!("moat_preview_{host_port}"),
            origin: format!("http://127.0.0.1:{host_port}"),
            port,
        });
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
    /// The link's own origin, `http://127.0.0.1:<listener port>`.
    origin: String,
    port: u16,
}

impl Guard {
    /// Whether `value` is this link's token, compared in time that does not
    /// depend on where they differ.
    fn is_token(&self, value: &str) -> bool {
        value.as_bytes().ct_eq(self.token.as_bytes()).into()
    }
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

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// The token is in the query: set the cookie and send the browser here.
    /// `page`: answer with a page that navigates (for a navigation from
    /// another site, whose redirect chain would stay cross-site).
    Redirect {
        location: String,
        page: bool,
    },
    /// The cookie is right: forward.
    Forward,
    Refuse(&'static str),
}

/// A request head, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Head {
    method: String,
    /// The request target as sent: `/path?query`.
    target: String,
    /// The `x` of `HTTP/1.x`.
    version: u8,
    /// Each header's name and value (without the spaces around it), in order.
    headers: Vec<(String, String)>,
}

impl Head {
    /// Parses the head at the start of `bytes`: the head and its length
    /// through its blank line, or `None` while it is not complete. A line
    /// that is no header (an obsolete folded continuation, say) is dropped:
    /// a header's value is judged whole or not forwarded.
    fn parse(bytes: &[u8]) -> Result<Option<(Self, usize)>, httparse::Error> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut headers);
        let mut config = httparse::ParserConfig::default();
        config.ignore_invalid_headers_in_requests(true);
        let httparse::Status::Complete(len) = config.parse_request(&mut request, bytes)? else {
            return Ok(None);
        };
        let head = Self {
            method: request.method.unwrap_or_default().to_owned(),
            target: request.path.unwrap_or_default().to_owned(),
            version: request.version.unwrap_or(1),
            headers: request
                .headers
                .iter()
                .map(|h| (h.name.to_owned(), String::from_utf8_lossy(h.value).into_owned()))
                .collect(),
        };
        Ok(Some((head, len)))
    }

    /// The value of each header `name`.
    fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers.iter().filter(move |(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

fn judge(head: &Head, guard: &Guard) -> Verdict {
    let target = head.target.as_str();
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut kept = Vec::new();
    let mut from_query = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.strip_prefix(TOKEN_PARAM).and_then(|v| v.strip_prefix('=')) {
            Some(value) => from_query = Some(value),
            None => kept.push(pair),
        }
    }
    let site = head.values("sec-fetch-site").next().map(str::to_ascii_lowercase);
    let own_pages = site.as_deref().is_none_or(|s| s == "same-origin" || s == "none");
    if let Some(value) = from_query {
        if !guard.is_token(value) {
            return Verdict::Refuse("the token in the address is not this link's");
        }
        let location = if kept.is_empty() { path.to_owned() } else { format!("{path}?{}", kept.join("&")) };
        let location = if location.starts_with('/') { location } else { "/".into() };
        return Verdict::Redirect { location, page: !own_pages };
    }
    if !own_pages {
        return Verdict::Refuse("a page of another site (another preview link's, say) may not use this link");
    }
    if head.values("origin").any(|origin| origin != guard.origin) {
        return Verdict::Refuse("a page of another origin (another preview link's, say) may not use this link");
    }
    let mut cookies = head
        .values("cookie")
        .flat_map(|value| value.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .filter(|(name, _)| *name == guard.cookie)
        .peekable();
    if cookies.peek().is_none() {
        return Verdict::Refuse("no token: open the link's full URL (with ?moat_token=…) first");
    }
    // Any cookie of this name with the right value counts: another page
    // may set one of the same name, but cannot unset the right one.
    if cookies.any(|(_, value)| guard.is_token(value)) {
        Verdict::Forward
    } else {
        Verdict::Refuse("the cookie holds another token")
    }
}

/// `head` as it may enter the sandbox: without `moat_*` cookies, `X-Moat-*`
/// headers or an `Authorization` holding a host secret ([`never_forward`]).
fn clean_head(head: &Head) -> String {
    let secrets = NEVER_FORWARD.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let mut out = format!("{} {} HTTP/1.{}\r\n", head.method, head.target, head.version);
    for (name, value) in &head.headers {
        let lower = name.to_ascii_lowercase();
        if lower.starts_with("x-moat") || lower.starts_with("moat") {
            continue;
        }
        if (lower == "authorization" || lower == "proxy-authorization")
            && secrets.iter().any(|s| value.contains(s.as_str()))
        {
            continue;
        }
        if lower == "cookie" {
            let kept: Vec<&str> = value
                .split(';')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .filter(|c| !c.split('=').next().unwrap_or_default().trim().to_ascii_lowercase().starts_with("moat_"))
                .collect();
            if !kept.is_empty() {
                out.push_str(&format!("{name}: {}\r\n", kept.join("; ")));
            }
            continue;
        }
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    out
}

/// How the body after a request head is framed.
#[derive(Debug, PartialEq, Eq)]
enum Body {
    /// This many bytes (0 for none).
    Length(u64),
    /// A WebSocket (or other) upgrade: raw bytes both ways from here on.
    Upgrade,
    /// Chunked or otherwise framed: not forwarded.
    Unsupported,
}

fn body_of(head: &Head) -> Body {
    if head.values("transfer-encoding").next().is_some() {
        return Body::Unsupported;
    }
    if head.values("upgrade").next().is_some() {
        return Body::Upgrade;
    }
    let mut lengths = head.values("content-length");
    match (lengths.next().map(str::parse::<u64>), lengths.next()) {
        (None, _) => Body::Length(0),
        (Some(Ok(n)), None) => Body::Length(n),
        _ => Body::Unsupported,
    }
}

async fn connection(mut stream: TcpStream, guard: &Guard, connect: &Connect) {
    let (head, rest) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream, Vec::new())).await {
        Ok(Some((Ok(head), rest))) => (head, rest),
        Ok(Some((Err(_), _))) => return refuse(stream, guard, "not an HTTP request").await,
        _ => return answer(stream, "400 Bad Request", "No complete request head.".into(), None).await,
    };
    match judge(&head, guard) {
        Verdict::Refuse(why) => refuse(stream, guard, why).await,
        Verdict::Redirect { location, page } => {
            let cookie = format!("Set-Cookie: {}={}; Path=/; HttpOnly; SameSite=Strict\r\n", guard.cookie, guard.token);
            if page {
                // A navigation of the page's own (same-origin) carries the cookie.
                let quoted = location.replace('&', "&amp;").replace('"', "&quot;").replace('<', "&lt;");
                let body = format!("<!doctype html><meta http-equiv=\"refresh\" content=\"0;url={quoted}\">");
                answer(stream, "200 OK", body, Some(format!("{cookie}Cache-Control: no-store\r\n"))).await;
            } else {
                answer(
                    stream,
                    "303 See Other",
                    "Redirecting.".into(),
                    Some(format!("Location: {location}\r\n{cookie}")),
                )
                .await;
            }
        }
        Verdict::Forward => {
            if body_of(&head) == Body::Unsupported {
                let why = "a request body must have one Content-Length (chunked bodies are not forwarded)";
                return answer(stream, "411 Length Required", why.into(), None).await;
            }
            let upstream = match connect() {
                Ok(client) => client.port_forward(guard.port).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let upstream = match upstream {
                Ok(upstream) => upstream,
                Err(why) => return answer(stream, "502 Bad Gateway", why, None).await,
            };
            let (mut from_client, mut to_client) = stream.into_split();
            let (mut from_sandbox, mut to_sandbox) = tokio::io::split(upstream);
            let requests = forward_requests(&mut from_client, &mut to_sandbox, guard, head, rest);
            tokio::select! {
                () = requests => {}
                _ = tokio::io::copy(&mut from_sandbox, &mut to_client) => {}
            }
        }
    }
}

/// Forwards request after request, each head judged and cleaned, each
/// body by its length, until the client ends, a head is refused, or an
/// upgrade makes the rest raw bytes.
async fn forward_requests(
    from_client: &mut (impl tokio::io::AsyncRead + Unpin),
    to_sandbox: &mut (impl tokio::io::AsyncWrite + Unpin),
    guard: &Guard,
    mut head: Head,
    mut buffered: Vec<u8>,
) {
    loop {
        if judge(&head, guard) != Verdict::Forward {
            return;
        }
        if to_sandbox.write_all(clean_head(&head).as_bytes()).await.is_err() {
            return;
        }
        match body_of(&head) {
            Body::Unsupported => return,
            Body::Upgrade => {
                if to_sandbox.write_all(&buffered).await.is_ok() {
                    let _ = tokio::io::copy(from_client, to_sandbox).await;
                }
                return;
            }
            Body::Length(mut left) => {
                let now = usize::try_from(left).unwrap_or(usize::MAX).min(buffered.len());
                if to_sandbox.write_all(&buffered[..now]).await.is_err() {
                    return;
                }
                buffered.drain(..now);
                left -= now as u64;
                let mut chunk = vec![0u8; 64 * 1024];
                while left > 0 {
                    let want = usize::try_from(left).unwrap_or(usize::MAX).min(chunk.len());
                    let n = match from_client.read(&mut chunk[..want]).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if to_sandbox.write_all(&chunk[..n]).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            }
        }
        let Some((Ok(next), rest)) = read_head(from_client, buffered).await else { return };
        head = next;
        buffered = rest;
    }
}

/// Reads one request head (through its blank line) after the bytes
/// already `buf`fered; returns it, or why it is not one, and what came
/// after it. `None`: the client ended first, or the head is longer than
/// [`MAX_HEAD`].
async fn read_head(
    stream: &mut (impl tokio::io::AsyncRead + Unpin),
    mut buf: Vec<u8>,
) -> Option<(Result<Head, httparse::Error>, Vec<u8>)> {
    let mut chunk = [0u8; 4096];
    loop {
        match Head::parse(&buf) {
            Ok(Some((head, len))) if len <= MAX_HEAD => return Some((Ok(head), buf.split_off(len))),
            Ok(Some(_)) => return None,
            Ok(None) if buf.len() >= MAX_HEAD => return None,
            Ok(None) => {}
            Err(e) => return Some((Err(e), Vec::new())),
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Answers 403 with `why`, then closes.
async fn refuse(stream: TcpStream, guard: &Guard, why: &str) {
    let body = format!("moat preview link for sandbox port {}: refused: {why}.", guard.port);
    answer(stream, "403 Forbidden", body, None).await;
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
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Head {
        Head::parse(text.as_bytes()).expect("a request head").expect("complete").0
    }

    fn guard() -> Guard {
        Guard {
            token: "a".repeat(32),
            cookie: "moat_preview_4000".into(),
            origin: "http://127.0.0.1:4000".into(),
            port: 8000,
        }
    }

    #[test]
    fn the_token_is_required_first_in_the_address_then_as_a_cookie() {
        let token = "a".repeat(32);
        let g = guard();
        assert_eq!(
            judge(&parsed(&format!("GET /app?x=1&moat_token={token} HTTP/1.1\r\n\r\n")), &g),
            Verdict::Redirect { location: "/app?x=1".into(), page: false }
        );
        assert_eq!(
            judge(&parsed(&format!("GET /?moat_token={token} HTTP/1.1\r\n\r\n")), &g),
            Verdict::Redirect { location: "/".into(), page: false }
        );
        assert_eq!(
            judge(&parsed(&format!("GET /x HTTP/1.1\r\nCookie: a=b; moat_preview_4000={token}\r\n\r\n")), &g),
            Verdict::Forward
        );
        assert!(matches!(judge(&parsed("GET / HTTP/1.1\r\n\r\n"), &g), Verdict::Refuse(_)));
        assert!(matches!(judge(&parsed("GET /?moat_token=bbbb HTTP/1.1\r\n\r\n"), &g), Verdict::Refuse(_)));
        let other_link = format!("GET / HTTP/1.1\r\nCookie: moat_preview_4001={token}\r\n\r\n");
        assert!(matches!(judge(&parsed(&other_link), &g), Verdict::Refuse(_)), "another link's cookie does not count");
        let wrong = format!("GET / HTTP/1.1\r\nCookie: moat_preview_4000={}\r\n\r\n", "b".repeat(32));
        assert!(matches!(judge(&parsed(&wrong), &g), Verdict::Refuse(_)));
    }

    #[test]
    fn no_moat_cookie_or_host_secret_enters_the_sandbox() {
        never_forward("host-secret-0123456789");
        let head = "GET /x HTTP/1.1\r\nHost: 127.0.0.1:4000\r\nCookie: app=1; moat_preview_4000=aaaa; \
                    MOAT_preview_4001=bbbb; theme=dark\r\nCookie: moat_preview_4002=cccc\r\n\
                    Authorization: Bearer host-secret-0123456789\r\nX-Moat-Token: t\r\nAccept: */*\r\n\r\n";
        let clean = clean_head(&parsed(head));
        assert!(clean.starts_with("GET /x HTTP/1.1\r\nHost: 127.0.0.1:4000\r\n"), "{clean}");
        assert!(clean.contains("Cookie: app=1; theme=dark\r\n") && clean.contains("Accept: */*"), "{clean}");
        for gone in ["moat_preview", "MOAT_preview", "aaaa", "bbbb", "cccc", "host-secret", "X-Moat"] {
            assert!(!clean.contains(gone), "{gone} was forwarded: {clean}");
        }
        assert!(clean.ends_with("\r\n\r\n"));
        let folded = clean_head(&parsed("GET / HTTP/1.1\r\nCookie: a=1\r\n b=2; moat_preview_1=t; c:d\r\n\r\n"));
        assert!(!folded.contains("moat_preview") && folded.contains("Cookie: a=1\r\n"), "{folded}");
        let basic = clean_head(&parsed("GET / HTTP/1.1\r\nAuthorization: Basic dXNlcjpwYXNz\r\n\r\n"));
        assert!(basic.contains("Authorization: Basic"), "the app's own credentials pass: {basic}");
    }

    #[test]
    fn pages_of_other_links_cannot_use_this_one() {
        let token = "a".repeat(32);
        let g = guard();
        let cookie = format!("Cookie: moat_preview_4000={token}");
        for from_elsewhere in [
            format!("GET / HTTP/1.1\r\n{cookie}\r\nSec-Fetch-Site: same-site\r\n\r\n"),
            format!("GET / HTTP/1.1\r\n{cookie}\r\nSec-Fetch-Site: cross-site\r\n\r\n"),
            format!("POST / HTTP/1.1\r\n{cookie}\r\nOrigin: http://127.0.0.1:4001\r\n\r\n"),
            format!("GET /ws HTTP/1.1\r\n{cookie}\r\nUpgrade: websocket\r\nOrigin: http://127.0.0.1:4001\r\n\r\n"),
        ] {
            assert!(matches!(judge(&parsed(&from_elsewhere), &g), Verdict::Refuse(_)), "{from_elsewhere}");
        }
        for own in [
            format!(
                "GET / HTTP/1.1\r\n{cookie}\r\nSec-Fetch-Site: same-origin\r\nOrigin: http://127.0.0.1:4000\r\n\r\n"
            ),
            format!("GET / HTTP/1.1\r\n{cookie}\r\nSec-Fetch-Site: none\r\n\r\n"),
            format!("GET / HTTP/1.1\r\nCookie: moat_preview_4000=forged; moat_preview_4000={token}\r\n\r\n"),
        ] {
            assert_eq!(judge(&parsed(&own), &g), Verdict::Forward, "{own}");
        }
        // Opened from another site, the token's page navigates itself, so
        // that the cookie goes with a same-origin request.
        let opened = format!("GET /?moat_token={token} HTTP/1.1\r\nSec-Fetch-Site: cross-site\r\n\r\n");
        assert_eq!(judge(&parsed(&opened), &g), Verdict::Redirect { location: "/".into(), page: true });
    }

    #[test]
    fn bodies_are_framed_by_length_only() {
        assert_eq!(body_of(&parsed("POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n")), Body::Length(5));
        assert_eq!(body_of(&parsed("GET / HTTP/1.1\r\n\r\n")), Body::Length(0));
        assert_eq!(body_of(&parsed("GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n")), Body::Upgrade);
        assert_eq!(body_of(&parsed("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")), Body::Unsupported);
        assert_eq!(
            body_of(&parsed("POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")),
            Body::Unsupported
        );
    }

    #[tokio::test]
    async fn every_request_on_a_kept_alive_connection_is_cleaned() {
        let token = "a".repeat(32);
        let g = guard();
        let first = format!("GET /1 HTTP/1.1\r\nCookie: moat_preview_4000={token}\r\n\r\n");
        let later = format!(
            "POST /2 HTTP/1.1\r\nContent-Length: 4\r\nCookie: moat_preview_4000={token}; moat_preview_4001=other\r\n\r\nbody\
             GET /3 HTTP/1.1\r\nCookie: moat_preview_4001=other\r\n\r\n"
        );
        let mut client = later.as_bytes();
        let mut sandbox = Vec::new();
        forward_requests(&mut client, &mut sandbox, &g, parsed(&first), Vec::new()).await;
        let seen = String::from_utf8_lossy(&sandbox);
        assert!(seen.contains("GET /1 HTTP/1.1\r\n") && seen.contains("POST /2 HTTP/1.1\r\n"), "{seen}");
        assert!(seen.ends_with("\r\n\r\nbody"), "the body passes, the refused third request does not: {seen}");
        assert!(!seen.contains("moat_preview") && !seen.contains("other"), "{seen}");
    }

    #[tokio::test]
    async fn a_head_is_read_across_reads_up_to_its_limit() {
        use tokio::io::AsyncReadExt as _;
        let mut split = (&b"GET /x HTTP/1.1\r\nCoo"[..]).chain(&b"kie: a=1\r\n\r\nnext"[..]);
        let (head, rest) = read_head(&mut split, Vec::new()).await.expect("a head");
        assert_eq!(head.expect("parses").values("cookie").collect::<Vec<_>>(), ["a=1"]);
        assert_eq!(rest, b"next");
        let head_of = |len: usize| {
            let start = "GET / HTTP/1.1\r\nX-Pad: ";
            format!("{start}{}\r\n\r\n", "a".repeat(len - start.len() - 4))
        };
        let mut at_limit = head_of(MAX_HEAD);
        assert!(matches!(read_head(&mut at_limit.as_bytes(), Vec::new()).await, Some((Ok(_), _))));
        at_limit.insert(24, 'a');
        assert!(read_head(&mut at_limit.as_bytes(), Vec::new()).await.is_none(), "one byte over the limit");
        let endless = "GET / HTTP/1.1\r\nX-Pad: ".to_owned() + &"a".repeat(2 * MAX_HEAD);
        assert!(read_head(&mut endless.as_bytes(), Vec::new()).await.is_none());
        let garbage = read_head(&mut &b"NOT HTTP\r\n\r\n"[..], Vec::new()).await;
        assert!(matches!(garbage, Some((Err(_), _))), "refused as not an HTTP request");
    }

    #[test]
    fn bare_line_feeds_end_lines_as_crlf_does() {
        let head = parsed("GET / HTTP/1.1\nCookie: a=1\nX-Moat-Token: t\r\nAccept: */*\n\n");
        let clean = clean_head(&head);
        assert_eq!(clean, "GET / HTTP/1.1\r\nCookie: a=1\r\nAccept: */*\r\n\r\n");
    }

    #[test]
    fn a_head_of_too_many_headers_is_not_one() {
        let head = format!("GET / HTTP/1.1\r\n{}\r\n", "A: b\r\n".repeat(MAX_HEADERS + 1));
        assert_eq!(Head::parse(head.as_bytes()), Err(httparse::Error::TooManyHeaders));
    }
}
