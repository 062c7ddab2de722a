//! Preview links: a listener (on the host's loopback, or on the address a
//! remote client reaches moat-mcp at: [`PreviewHost`]) that forwards each
//! connection to one port inside one sandbox, through the agent's
//! `port_forward`, for whoever holds the link's token.
//!
//! A browser opens `http://<host>:<listener>/?moat_token=<token>`; the
//! link answers with a redirect that drops the token from the address and
//! sets a session cookie named after the listener's port (cookies ignore
//! ports, so each link has its own name). Later requests carry the cookie.
//! A token opens its link once: it is exchanged for the cookie on first
//! use, and refused after (a link read from a log, a history or a shared
//! screen opens nothing); asking for the link again mints a new token for
//! the same listener. Tokens and sessions are valid for their own
//! listener only; the listener and every connection through it end with
//! the sandbox.
//!
//! Every request head on a connection is checked and cleaned, not only the
//! first (keep-alive would otherwise carry later heads through unseen):
//!
//! - its cookie must be this link's, and it must come from this link's own
//!   pages: a browser's `Sec-Fetch-Site` must be `same-origin` or `none`,
//!   and an `Origin` this link's own, so a page served through another
//!   link cannot use this one (on the host's loopback each link is also a
//!   site of its own, its own address in 127.0.0.0/8: [`PreviewHost`]);
//! - what goes into the sandbox carries no `moat_*` cookie (no link's
//!   token), no `X-Moat-*` header and no `Authorization` holding a secret
//!   of the host ([`never_forward`], such as moat-mcp's HTTP token).
//!
//! Request bodies are forwarded by `Content-Length`; a chunked request body
//! is refused (411). After a WebSocket upgrade request, bytes flow
//! unchanged both ways.
//!
//! A link serves [`MAX_CONNECTIONS`] at once. Past that, a new connection
//! closes the oldest one on which no request has shown the link's session
//! or token ([`crate::net::places`]): strangers who reach a remote link's
//! address can take only one another's places, never the user's.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use moat_proto::{AgentClient, UnixConnector};
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::error::SandboxError;
use crate::net::places::{Places, Vouched};

/// The largest request head a link reads.
const MAX_HEAD: usize = 16 * 1024;
/// The most headers a request head may have.
const MAX_HEADERS: usize = 128;
/// How long a client may take to send its first request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections one link carries at once.
const MAX_CONNECTIONS: usize = 64;
/// The most ports one sandbox has preview links for: each is a listener
/// and a task on the host, until the sandbox ends.
pub const MAX_LINKS: usize = 16;
/// The query parameter that carries the token.
pub const TOKEN_PARAM: &str = "moat_token";
/// How long a link waits for the sandbox's agent to connect it to the
/// port (a local connect inside the sandbox: an agent that takes longer
/// is stuck or hostile, and would hold one of the link's connections).
const FORWARD_GUARD: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a full link waits for the place of a connection it closed to
/// make room (its task ends at once; the bound is against a stuck one).
const ROOM_WAIT: Duration = Duration::from_secs(1);

/// How long a link's accept loop pauses after a failed accept.
const ACCEPT_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Unused tokens, used tokens and sessions one link remembers, each: the
/// oldest go first.
const REMEMBERED: usize = 64;

/// Where preview links listen, and the host name their URLs carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviewHost {
    /// The address listeners bind (port 0: the kernel picks one per link).
    pub bind: IpAddr,
    /// The host of the links' URLs: an address or a name, an IPv6 address
    /// in brackets, or a name under a wildcard (`*.preview.example.com`),
    /// whose `*` each link fills with a label of its own.
    pub host: String,
    /// Links may share one host that is not the loopback's own per link
    /// (`MOAT_PREVIEW_SHARED_HOST=1`): see [`PreviewHost::listen`].
    pub shared: bool,
}

/// The setting that lets preview links share one host (see
/// [`PreviewHost::listen`]).
pub const SHARED_HOST_ENV: &str = "MOAT_PREVIEW_SHARED_HOST";

impl Default for PreviewHost {
    /// The host's loopback: links for a browser on this machine.
    fn default() -> Self {
        Self { bind: IpAddr::V4(Ipv4Addr::LOCALHOST), host: "127.0.0.1".into(), shared: false }
    }
}

impl PreviewHost {
    /// Links for clients of an HTTP server listening on `http`: on its
    /// address, named by `base` (`MOAT_PREVIEW_URL`, `http://HOST`) when
    /// given, else by the address itself, or by this machine's host name
    /// when the address is unspecified (0.0.0.0 or ::). A loopback server
    /// without `base` gets loopback links, as over stdio.
    pub fn for_http(http: SocketAddr, base: Option<&str>) -> Result<Self, String> {
        let named = base.map(parse_base).transpose()?;
        let ip = http.ip();
        if ip.is_loopback() && named.is_none() {
            return Ok(Self::default());
        }
        let host = match named {
            Some(host) => host,
            None if ip.is_unspecified() => nix::unistd::gethostname()
                .ok()
                .and_then(|name| name.into_string().ok())
                .filter(|name| !name.is_empty())
                .ok_or("moat-mcp listens on every address and this machine has no host name: set MOAT_PREVIEW_URL=http://HOST to name the host preview links use")?,
            None => match ip {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            },
        };
        Ok(Self { bind: ip, host, shared: false })
    }

    /// [`PreviewHost::for_http`] with `MOAT_PREVIEW_URL` and
    /// `MOAT_PREVIEW_SHARED_HOST` from the environment.
    pub fn for_http_from_env(http: SocketAddr) -> Result<Self, String> {
        let base = std::env::var("MOAT_PREVIEW_URL").ok().filter(|v| !v.trim().is_empty());
        let shared = match std::env::var(SHARED_HOST_ENV).ok().as_deref().map(str::trim) {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(other) => return Err(format!("{SHARED_HOST_ENV} must be 1 or 0, got {other:?}")),
        };
        Ok(Self { shared, ..Self::for_http(http, base.as_deref())? })
    }

    /// Where one link listens and the host its URL names. On the host's
    /// loopback each link gets an address of its own in 127.0.0.0/8 (all
    /// of it is this machine's): a browser keeps cookies per host, not per
    /// port, and counts one host as one site, so on a shared 127.0.0.1 a
    /// sandbox's page, served through its link, could set cookies for every
    /// other link and every web service of the user on that address, and
    /// pass their `SameSite` checks. Elsewhere (a remote client's links)
    /// the configured address serves them all, under one name (links
    /// there share a site, and so their cookies) unless that name is a
    /// wildcard (`*.preview.example.com`, whose every name the operator's
    /// DNS points here): then each link is a host of its own,
    /// `<random label>.preview.example.com`. Where the loopback takes no
    /// address but 127.0.0.1, no link is made: one there would share its
    /// host, and so the browser's cookies for it, with every other.
    async fn listen(&self) -> std::io::Result<(TcpListener, String)> {
        if *self == Self::default() {
            let own = link_address()?;
            return match TcpListener::bind((own, 0)).await {
                Ok(listener) => Ok((listener, own.to_string())),
                Err(e) => Err(std::io::Error::new(
                    e.kind(),
                    format!(
                        "this host's loopback takes no address of its own for the link ({own}: {e}); a link on \
                         127.0.0.1 would share the browser's cookies for it with every other link and local web \
                         service, so none is made: serve moat-mcp over HTTP with MOAT_PREVIEW_URL=http://*.NAME, \
                         a wildcard name for previews alone"
                    ),
                )),
            };
        }
        let host = match self.host.strip_prefix("*.") {
            Some(parent) => format!("{}.{parent}", link_label()?),
            None if self.shared => self.host.clone(),
            None => return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, self.shared_refused())),
        };
        Ok((TcpListener::bind((self.bind, 0)).await?, host))
    }

    /// Why no link is made on a host links would share: a browser sends a
    /// host's cookies to every port of it, so every sandbox's server would
    /// receive those of every other link and of every web service on that
    /// host (a notebook's, a dashboard's session), and could set theirs.
    fn shared_refused(&self) -> String {
        format!(
            "preview links here would all be on {host}, and a browser sends {host}'s cookies (other links', and \
             those of every web service on {host}) to each, so none is made. The operator can set \
             MOAT_PREVIEW_URL=http://*.NAME, a wildcard name whose every label reaches this machine (each link \
             then a host of its own), or accept the sharing with {SHARED_HOST_ENV}=1",
            host = self.host
        )
    }
}

/// A random address of the loopback network other than 127.0.0.1 and the
/// network's first and last.
fn link_address() -> std::io::Result<Ipv4Addr> {
    loop {
        let mut bytes = [0u8; 3];
        getrandom::fill(&mut bytes)?;
        let address = Ipv4Addr::new(127, bytes[0], bytes[1], bytes[2]);
        if !matches!(bytes, [0, 0, 0 | 1] | [255, 255, 255]) {
            return Ok(address);
        }
    }
}

/// A DNS label no one can guess: 20 random letters and digits (about 103
/// bits), so that a link's host names no other link's.
fn link_label() -> std::io::Result<String> {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut bytes = [0u8; 20];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| char::from(ALPHABET[usize::from(b % 32)])).collect())
}

fn url(host: &str, port: u16, token: &str) -> String {
    format!("http://{host}:{port}/?{TOKEN_PARAM}={token}")
}

/// The host of a `MOAT_PREVIEW_URL` (`http://HOST`, a path or port after
/// it ignored: each link has its own port; `http://*.NAME`, a host per
/// link); an error says what is allowed.
fn parse_base(base: &str) -> Result<String, String> {
    let rule = "MOAT_PREVIEW_URL must be http://HOST (a name or address that clients reach this machine at; \
                each link adds its own port) or http://*.NAME (a wildcard name whose every host reaches this \
                machine: each link gets a host of its own)";
    let rest = base.trim().strip_prefix("http://").ok_or_else(|| {
        if base.trim().starts_with("https://") {
            format!("{rule}: preview links are served over plain HTTP, not {base:?}")
        } else {
            format!("{rule}, not {base:?}")
        }
    })?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split_once(']').map(|(inside, _)| format!("[{inside}]")).unwrap_or_default()
    } else {
        authority.split(':').next().unwrap_or_default().to_owned()
    };
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '[' | ']' | ':');
    let name = host.strip_prefix("*.").unwrap_or(&host);
    if name.is_empty() || name.contains('@') || !name.chars().all(plain) {
        return Err(format!("{rule}, not {base:?}"));
    }
    if name.len() != host.len() && (name.contains(['[', ':']) || !name.contains('.') || name.ends_with('.')) {
        return Err(format!("{rule}: a wildcard goes before a DNS name of two labels or more, not {base:?}"));
    }
    // As a browser writes it in an Origin (the URL standard's host: lower
    // case, an IPv4 address in four decimals, an IPv6 one in its shortest
    // form): links' origins are compared with it exactly.
    let as_browsers_write = |host: &str| {
        url::Url::parse(&format!("http://{host}/"))
            .ok()
            .and_then(|url| url.host_str().map(str::to_owned))
            .ok_or_else(|| format!("{rule}, not {base:?}"))
    };
    match host.strip_prefix("*.") {
        Some(name) => Ok(format!("*.{}", as_browsers_write(name)?)),
        None => as_browsers_write(&host),
    }
}

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
pub type Connect = Arc<
    dyn Fn() -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<AgentClient<UnixConnector>, SandboxError>> + Send>,
        > + Send
        + Sync,
>;

/// What a caller gets: where to point a browser.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreviewLink {
    /// The URL with the token, ready for a browser; it opens once.
    pub url: String,
    /// The port inside the sandbox.
    pub port: u16,
    /// The one-time token in the URL.
    pub token: String,
    /// The port of the listener (on the [`PreviewHost`]).
    pub host_port: u16,
    /// Seconds since the Unix epoch: when the sandbox (and the link) ends.
    pub expires_at: u64,
}

/// A live link; dropping it closes the listener and its connections.
#[derive(Debug)]
pub struct Preview {
    /// The link without a token (`token` empty, the URL's ends at `=`).
    link: PreviewLink,
    guard: Arc<Guard>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Preview {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Preview {
    /// Listens on `host` for links to `port` in the sandbox.
    pub async fn start(port: u16, expires_at: u64, host: &PreviewHost, connect: Connect) -> std::io::Result<Self> {
        let (listener, name) = host.listen().await?;
        let host_port = listener.local_addr()?.port();
        let link = PreviewLink { url: url(&name, host_port, ""), port, token: String::new(), host_port, expires_at };
        let guard = Arc::new(Guard {
            tokens: Mutex::default(),
            cookie: format!("moat_preview_{host_port}"),
            origin: format!("http://{name}:{host_port}"),
            port,
        });
        let task = tokio::spawn(serve(listener, guard.clone(), connect));
        Ok(Self { link, guard, task })
    }

    /// A link with a fresh one-time token, for this listener.
    pub fn new_link(&self) -> std::io::Result<PreviewLink> {
        let token = new_token()?;
        remember(&mut self.guard.tokens.lock().unwrap_or_else(PoisonError::into_inner).fresh, token.clone());
        let url = self.link.url.replacen(&format!("{TOKEN_PARAM}="), &format!("{TOKEN_PARAM}={token}"), 1);
        Ok(PreviewLink { url, token, ..self.link.clone() })
    }
}

/// Keeps `value` in `list`, dropping the oldest past [`REMEMBERED`].
fn remember(list: &mut Vec<String>, value: String) {
    if list.len() >= REMEMBERED {
        list.remove(0);
    }
    list.push(value);
}

/// A link's secrets: one-time tokens not yet used, those used, and the
/// sessions (cookie values) they were exchanged for.
#[derive(Debug, Default)]
struct Tokens {
    fresh: Vec<String>,
    used: Vec<String>,
    sessions: Vec<String>,
}

struct Guard {
    tokens: Mutex<Tokens>,
    cookie: String,
    /// The link's own origin, `http://<host>:<listener port>`.
    origin: String,
    port: u16,
}

/// Without its secrets: a `Preview` may be logged.
impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("cookie", &self.cookie)
            .field("origin", &self.origin)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

/// Whether `value` is one of `secrets`, each compared in time that does
/// not depend on where they differ.
fn holds(secrets: &[String], value: &str) -> Option<usize> {
    secrets.iter().position(|secret| bool::from(value.as_bytes().ct_eq(secret.as_bytes())))
}

impl Guard {
    /// Exchanges one-time `token` for a new session; why not when it
    /// cannot be.
    fn redeem(&self, token: &str) -> Result<String, &'static str> {
        let mut tokens = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(at) = holds(&tokens.fresh, token) else {
            return Err(if holds(&tokens.used, token).is_some() {
                "this link was opened already: a link opens once; ask preview_link for a new one"
            } else {
                "the token in the address is not this link's"
            });
        };
        let session = new_token().map_err(|_| "no session could be made (the host's random source failed)")?;
        let used = tokens.fresh.remove(at);
        remember(&mut tokens.used, used);
        remember(&mut tokens.sessions, session.clone());
        Ok(session)
    }

    /// Whether `value` is one of this link's sessions.
    fn is_session(&self, value: &str) -> bool {
        holds(&self.tokens.lock().unwrap_or_else(PoisonError::into_inner).sessions, value).is_some()
    }
}

async fn serve(listener: TcpListener, guard: Arc<Guard>, connect: Connect) {
    let places = Places::new(MAX_CONNECTIONS);
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    // Out of descriptors (EMFILE), the listener stays
                    // ready and accept fails at once: without a pause this
                    // loop would spin a worker that every other link and
                    // the MCP server share. Not a poll: the next accept
                    // waits on the listener as ever.
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                };
                // At the most, the oldest connection that has not shown the
                // link's session goes (strangers who reach a remote link's
                // address cannot keep its user out); one the user's browser
                // holds never does.
                let place = match places.try_take() {
                    Some(place) => Some(place),
                    None if places.make_room() => tokio::time::timeout(ROOM_WAIT, places.take()).await.ok(),
                    None => None,
                };
                let Some(place) = place else {
                    connections.spawn(answer(stream, "503 Service Unavailable", "Too many connections through this preview link.".into(), None));
                    continue;
                };
                let (guard, connect) = (guard.clone(), connect.clone());
                connections.spawn(async move {
                    tokio::select! {
                        () = connection(stream, &guard, &connect, place.vouched()) => {}
                        () = place.closed() => {}
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// The token is in the query and was exchanged for `session`: set the
    /// cookie and send the browser here. `page`: answer with a page that
    /// navigates (for a navigation from another site, whose redirect chain
    /// would stay cross-site).
    Redirect {
        location: String,
        page: bool,
        /// `None` when the request held a session of the link already (a
        /// reload of the URL with its spent token, say).
        session: Option<String>,
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
        let session = match guard.redeem(value) {
            Ok(session) => Some(session),
            // The token is spent (or another's), but this browser holds a
            // session of the link: the address is cleaned, nothing more.
            Err(_) if own_pages && holds_session(head, guard) => None,
            Err(why) => return Verdict::Refuse(why),
        };
        let location = if kept.is_empty() { path.to_owned() } else { format!("{path}?{}", kept.join("&")) };
        // A path of this link only: `//host/…` and `/\host/…` are other
        // sites to a browser (a genuine link would send its user there).
        let own_path = location.starts_with('/') && !location.starts_with("//") && !location.starts_with("/\\");
        let location = if own_path { location } else { "/".into() };
        return Verdict::Redirect { location, page: !own_pages, session };
    }
    if !own_pages {
        return Verdict::Refuse("a page of another site (another preview link's, say) may not use this link");
    }
    if head.values("origin").any(|origin| origin != guard.origin) {
        return Verdict::Refuse("a page of another origin (another preview link's, say) may not use this link");
    }
    if link_cookies(head, guard).next().is_none() {
        return Verdict::Refuse("no token: open the link's full URL (with ?moat_token=…) first");
    }
    if holds_session(head, guard) {
        Verdict::Forward
    } else {
        Verdict::Refuse("the cookie is no session of this link: open a new link from preview_link")
    }
}

/// The values of the request's cookies named for this link.
fn link_cookies<'a>(head: &'a Head, guard: &'a Guard) -> impl Iterator<Item = &'a str> + 'a {
    head.values("cookie")
        .flat_map(|value| value.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .filter(|(name, _)| *name == guard.cookie)
        .map(|(_, value)| value)
}

/// Whether the request holds a session of this link. Any cookie of the
/// link's name with the right value counts: another page may set one of
/// the same name, but cannot unset the right one.
fn holds_session(head: &Head, guard: &Guard) -> bool {
    link_cookies(head, guard).any(|value| guard.is_session(value))
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

async fn connection(mut stream: TcpStream, guard: &Guard, connect: &Connect, vouched: &Vouched) {
    let (head, rest) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream, Vec::new())).await {
        Ok(Some((Ok(head), rest))) => (head, rest),
        Ok(Some((Err(_), _))) => return refuse(stream, guard, "not an HTTP request").await,
        _ => return answer(stream, "400 Bad Request", "No complete request head.".into(), None).await,
    };
    match judge(&head, guard) {
        Verdict::Refuse(why) => refuse(stream, guard, why).await,
        Verdict::Redirect { location, page, session } => {
            vouched.set();
            let cookie = session.map_or_else(String::new, |session| {
                format!("Set-Cookie: {}={session}; Path=/; HttpOnly; SameSite=Strict\r\n", guard.cookie)
            });
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
            vouched.set();
            if body_of(&head) == Body::Unsupported {
                let why = "a request body must have one Content-Length (chunked bodies are not forwarded)";
                return answer(stream, "411 Length Required", why.into(), None).await;
            }
            let upstream = match connect().await {
                Ok(client) => match tokio::time::timeout(FORWARD_GUARD, client.port_forward(guard.port)).await {
                    Ok(forwarded) => forwarded.map_err(|e| e.to_string()),
                    Err(_) => Err(format!(
                        "the sandbox's agent did not open port {} within {} s",
                        guard.port,
                        FORWARD_GUARD.as_secs()
                    )),
                },
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

    /// A link with two unused tokens ("a…" and "c…") and one session ("s…").
    fn guard() -> Guard {
        Guard {
            tokens: Mutex::new(Tokens {
                fresh: vec!["a".repeat(32), "c".repeat(32)],
                used: Vec::new(),
                sessions: vec!["s".repeat(32)],
            }),
            cookie: "moat_preview_4000".into(),
            origin: "http://127.0.0.1:4000".into(),
            port: 8000,
        }
    }

    /// The location, page and new session of a redirect that made one.
    fn redirect(verdict: Verdict) -> (String, bool, String) {
        match verdict {
            Verdict::Redirect { location, page, session: Some(session) } => (location, page, session),
            other => panic!("not a redirect with a new session: {other:?}"),
        }
    }

    #[test]
    fn a_token_opens_its_link_once_then_its_session_cookie_does() {
        let (token, other) = ("a".repeat(32), "c".repeat(32));
        let g = guard();
        let (location, page, session) =
            redirect(judge(&parsed(&format!("GET /app?x=1&moat_token={token} HTTP/1.1\r\n\r\n")), &g));
        assert_eq!((location.as_str(), page), ("/app?x=1", false));
        assert!(session.len() == 32 && session != token, "a session of its own, not the token: {session}");
        match judge(&parsed(&format!("GET /?moat_token={token} HTTP/1.1\r\n\r\n")), &g) {
            Verdict::Refuse(why) => assert!(why.contains("opened already") && why.contains("preview_link"), "{why}"),
            verdict => panic!("a used token opened the link again: {verdict:?}"),
        }
        // The spent token again, from the browser that holds its session
        // (a reload): the address is cleaned, and no new session made.
        let reload = format!("GET /app?moat_token={token} HTTP/1.1\r\nCookie: moat_preview_4000={session}\r\n\r\n");
        assert_eq!(
            judge(&parsed(&reload), &g),
            Verdict::Redirect { location: "/app".into(), page: false, session: None }
        );
        let (location, _, second) = redirect(judge(&parsed(&format!("GET /?moat_token={other} HTTP/1.1\r\n\r\n")), &g));
        assert_eq!(location, "/");
        assert_ne!(second, session, "each opening gets its own session");
        for good in [&session, &second, &"s".repeat(32)] {
            let head = format!("GET /x HTTP/1.1\r\nCookie: a=b; moat_preview_4000={good}\r\n\r\n");
            assert_eq!(judge(&parsed(&head), &g), Verdict::Forward);
        }
        assert!(matches!(judge(&parsed("GET / HTTP/1.1\r\n\r\n"), &g), Verdict::Refuse(_)));
        match judge(&parsed("GET /?moat_token=bbbb HTTP/1.1\r\n\r\n"), &g) {
            Verdict::Refuse(why) => assert!(why.contains("not this link's"), "{why}"),
            verdict => panic!("{verdict:?}"),
        }
        let other_link = format!("GET / HTTP/1.1\r\nCookie: moat_preview_4001={session}\r\n\r\n");
        assert!(matches!(judge(&parsed(&other_link), &g), Verdict::Refuse(_)), "another link's cookie does not count");
        let token_as_cookie = format!("GET / HTTP/1.1\r\nCookie: moat_preview_4000={token}\r\n\r\n");
        assert!(matches!(judge(&parsed(&token_as_cookie), &g), Verdict::Refuse(_)), "a token is no session");
        let wrong = format!("GET / HTTP/1.1\r\nCookie: moat_preview_4000={}\r\n\r\n", "b".repeat(32));
        assert!(matches!(judge(&parsed(&wrong), &g), Verdict::Refuse(_)));
    }

    #[test]
    fn a_token_redirects_within_its_link_only() {
        let token = "a".repeat(32);
        for (target, expected) in [("//evil.example/x", "/"), ("/\\evil.example/x", "/"), ("/ok//x", "/ok//x")] {
            let opened = format!("GET {target}?moat_token={token} HTTP/1.1\r\n\r\n");
            let (location, _, _) = redirect(judge(&parsed(&opened), &guard()));
            assert_eq!(location, expected, "{target}");
        }
    }

    #[test]
    fn preview_hosts_follow_the_http_address_or_moat_preview_url() {
        let at = |addr: &str| addr.parse::<SocketAddr>().expect("an address");
        assert_eq!(PreviewHost::for_http(at("127.0.0.1:8080"), None), Ok(PreviewHost::default()));
        let lan = PreviewHost::for_http(at("10.1.2.3:8080"), None).expect("a host");
        assert_eq!((lan.bind.to_string(), lan.host.as_str()), ("10.1.2.3".into(), "10.1.2.3"));
        assert_eq!(url(&lan.host, 4000, "t"), "http://10.1.2.3:4000/?moat_token=t");
        let v6 = PreviewHost::for_http(at("[fd00::1]:8080"), None).expect("a host");
        assert_eq!(v6.host, "[fd00::1]");
        let named = PreviewHost::for_http(at("0.0.0.0:8080"), Some("http://devbox.lan:9999/x")).expect("a host");
        assert_eq!((named.bind.to_string(), named.host.as_str()), ("0.0.0.0".into(), "devbox.lan"));
        let tunnel = PreviewHost::for_http(at("127.0.0.1:8080"), Some("http://[fd00::2]")).expect("a host");
        assert_eq!((tunnel.bind.to_string(), tunnel.host.as_str()), ("127.0.0.1".into(), "[fd00::2]"));
        // Written as a browser writes an Origin, which the links compare
        // exactly: in lower case, an IPv6 address in its shortest form.
        let cased = PreviewHost::for_http(at("0.0.0.0:8080"), Some("http://DevBox.LAN")).expect("a host");
        assert_eq!(cased.host, "devbox.lan");
        let long = PreviewHost::for_http(at("0.0.0.0:8080"), Some("http://[FD00::0002]")).expect("a host");
        assert_eq!(long.host, "[fd00::2]");
        let mapped = PreviewHost::for_http(at("0.0.0.0:8080"), Some("http://[::ffff:1.2.3.4]")).expect("a host");
        assert_eq!(mapped.host, "[::ffff:102:304]");
        let short = PreviewHost::for_http(at("0.0.0.0:8080"), Some("http://10.1")).expect("a host");
        assert_eq!(short.host, "10.0.0.1");
        let wild = PreviewHost::for_http(at("0.0.0.0:8080"), Some("http://*.Preview.Example.com")).expect("a host");
        assert_eq!(wild.host, "*.preview.example.com");
        for bad in [
            "https://devbox.lan",
            "devbox.lan",
            "http://",
            "http://user@devbox",
            "http://a b",
            "http://*.",
            "http://*.lan",
            "http://*.[fd00::2]",
            "http://a.*.lan",
            "http://*.*.lan",
            "http://[fd00::zz]",
        ] {
            let why = PreviewHost::for_http(at("0.0.0.0:1"), Some(bad)).expect_err(bad);
            assert!(why.contains("MOAT_PREVIEW_URL must be http://HOST"), "{bad}: {why}");
        }
    }

    #[tokio::test]
    async fn a_wildcard_preview_url_gives_each_link_a_host_of_its_own() {
        let at = |addr: &str| addr.parse::<SocketAddr>().expect("an address");
        let host = PreviewHost::for_http(at("127.0.0.1:8080"), Some("http://*.preview.example.com:1/x"))
            .expect("a wildcard host");
        assert_eq!(host.host, "*.preview.example.com");
        let mut names = std::collections::HashSet::new();
        for _ in 0..8 {
            let (listener, name) = host.listen().await.expect("a listener");
            let label = name.strip_suffix(".preview.example.com").expect("under the wildcard's name");
            assert!(label.len() == 20 && label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()), "{name}");
            assert!(listener.local_addr().expect("bound").ip().is_loopback());
            names.insert(name);
        }
        assert_eq!(names.len(), 8, "each link a host of its own");
        // A link's origin is its own host: a page of another link's host is
        // another origin, refused.
        let connect: Connect = Arc::new(|| Box::pin(async { Err(SandboxError::Expired("none".into())) }));
        let preview = Preview::start(3000, 0, &host, connect).await.expect("a link");
        let link = preview.new_link().expect("a link");
        let own = link.url.split('/').nth(2).expect("an authority").to_owned();
        assert!(own.ends_with(&format!(".preview.example.com:{}", link.host_port)), "{}", link.url);
        assert_eq!(preview.guard.origin, format!("http://{own}"));
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
        let (token, session) = ("a".repeat(32), "s".repeat(32));
        let g = guard();
        let cookie = format!("Cookie: moat_preview_4000={session}");
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
            format!("GET / HTTP/1.1\r\nCookie: moat_preview_4000=forged; moat_preview_4000={session}\r\n\r\n"),
        ] {
            assert_eq!(judge(&parsed(&own), &g), Verdict::Forward, "{own}");
        }
        // Opened from another site, the token's page navigates itself, so
        // that the cookie goes with a same-origin request.
        let opened = format!("GET /?moat_token={token} HTTP/1.1\r\nSec-Fetch-Site: cross-site\r\n\r\n");
        let (location, page, _) = redirect(judge(&parsed(&opened), &g));
        assert_eq!((location.as_str(), page), ("/", true));
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

    /// On the host's loopback each link is a site of its own: its own
    /// address in 127.0.0.0/8, which its URL and origin name, and nothing
    /// of it on 127.0.0.1, where the user's own web services are.
    #[tokio::test]
    async fn loopback_links_each_listen_on_an_address_of_their_own() {
        let connect: Connect = Arc::new(|| Box::pin(async { Ok(AgentClient::unix("/nonexistent")) }));
        let host = PreviewHost::default();
        let a = Preview::start(8000, 0, &host, connect.clone()).await.expect("listens");
        let b = Preview::start(8000, 0, &host, connect).await.expect("listens");
        let address = |p: &Preview| -> Ipv4Addr {
            let rest = p.link.url.strip_prefix("http://").expect("http");
            rest.split(':').next().expect("a host").parse().expect("an address")
        };
        let (one, two) = (address(&a), address(&b));
        assert_ne!(one, two, "two links share a site");
        for (ip, p) in [(one, &a), (two, &b)] {
            assert!(ip.is_loopback() && ip != Ipv4Addr::LOCALHOST, "{ip}");
            assert_eq!(p.guard.origin, format!("http://{ip}:{}", p.link.host_port));
            TcpStream::connect((ip, p.link.host_port)).await.expect("the link's own address answers");
            assert!(
                TcpStream::connect((Ipv4Addr::LOCALHOST, p.link.host_port)).await.is_err(),
                "the link listens on 127.0.0.1 too"
            );
        }
        // A remote client's links on one host they would share: refused,
        // unless the operator accepts the sharing; then they keep the
        // address they were given.
        let mut remote = PreviewHost { bind: IpAddr::V4(Ipv4Addr::LOCALHOST), host: "[fd00::2]".into(), shared: false };
        let connect: Connect = Arc::new(|| Box::pin(async { Ok(AgentClient::unix("/nonexistent")) }));
        let Err(refused) = Preview::start(8000, 0, &remote, connect.clone()).await else {
            panic!("a link on a shared host without the operator's consent")
        };
        let refused = refused.to_string();
        assert!(refused.contains("MOAT_PREVIEW_URL=http://*.NAME") && refused.contains(SHARED_HOST_ENV), "{refused}");
        remote.shared = true;
        let c = Preview::start(8000, 0, &remote, connect).await.expect("listens");
        assert!(c.link.url.starts_with("http://[fd00::2]:"), "{}", c.link.url);
    }

    /// A remote link's address is reachable by anyone on the network: at
    /// the most connections, strangers that send nothing make room for the
    /// link's user (a 503 before).
    #[tokio::test]
    async fn strangers_holding_every_connection_do_not_keep_the_links_user_out() {
        use tokio::io::AsyncReadExt as _;
        let connect: Connect = Arc::new(|| Box::pin(async { Ok(AgentClient::unix("/nonexistent")) }));
        let preview = Preview::start(8000, 0, &PreviewHost::default(), connect).await.expect("listens");
        let link = preview.new_link().expect("a link");
        let rest = link.url.strip_prefix("http://").expect("http");
        let address = rest.split('/').next().expect("an authority").to_owned();
        let mut strangers = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            strangers.push(TcpStream::connect(&address).await.expect("a stranger connects"));
        }
        let mut user = TcpStream::connect(&address).await.expect("the user connects");
        let request = format!("GET /?{TOKEN_PARAM}={} HTTP/1.1\r\nHost: {address}\r\n\r\n", link.token);
        user.write_all(request.as_bytes()).await.expect("sent");
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), user.read_to_string(&mut answer))
            .await
            .expect("answered before a stranger's head timed out")
            .expect("read");
        assert!(answer.starts_with("HTTP/1.1 303") && answer.contains("Set-Cookie: moat_preview_"), "{answer}");
        let mut byte = [0u8; 1];
        let oldest = tokio::time::timeout(Duration::from_secs(5), strangers[0].read(&mut byte)).await;
        assert!(matches!(oldest, Ok(Ok(0))), "the oldest stranger was closed to make room: {oldest:?}");
    }

    #[tokio::test]
    async fn every_request_on_a_kept_alive_connection_is_cleaned() {
        let token = "s".repeat(32);
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
