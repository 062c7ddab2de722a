//! Streamable HTTP at `/mcp` (`moat-mcp --http`).
//!
//! The transport itself is rmcp's `StreamableHttpService`, mounted in an
//! axum router behind one gate that every request passes:
//!
//! - `Host` must be exactly the address the server listens on, and a
//!   browser's `Origin` exactly `http://` + that address, so a web page
//!   cannot reach the server through DNS rebinding;
//! - `Authorization: Bearer <token>` is always required (401 with
//!   `WWW-Authenticate` otherwise): loopback is not a trust boundary, since
//!   every local account can reach it. The token is `MOAT_HTTP_TOKEN`, or
//!   when that is unset one generated at start and written to a file only
//!   its owner can read ([`TokenFile`]), whose path is printed on stderr.
//!
//! Every POST body is read here first, at most
//! [`MAX_MESSAGE_BYTES`](crate::limits::MAX_MESSAGE_BYTES) of it: one over
//! that is answered 413 with a JSON-RPC error naming the limit, one that is
//! not a JSON-RPC message 400 with a JSON-RPC error. Responses are kept in
//! an [`EventLog`] so that a client whose SSE stream dropped gets them when
//! it reconnects with `Last-Event-ID`.
//!
//! Each MCP session gets its own [`MoatServer`] and so its own [`Scope`]:
//! sessions cannot see each other's sandboxes, and a session's sandboxes
//! are destroyed when it closes or expires. Requests without a session
//! (protocol 2026-07-28 has no sessions) share one scope of their own.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use moat_core::net::places::{Places, Vouched};
use moat_core::{Moat, SandboxSpec};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;

use crate::MoatServer;
use crate::event_log::EventLog;
use crate::limits::{IdScanner, MAX_MESSAGE_BYTES, too_large_response};
use crate::scope::Scope;
use crate::stdio::Parsed;

/// Where and how `moat-mcp --http` serves.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub host: IpAddr,
    /// 0 picks a free port (the URL is printed on stderr).
    pub port: u16,
    /// The bearer token every request must carry.
    pub token: String,
    /// TEST ONLY (`MOAT_TEST_CONFORMANCE_TOOLS`): list and serve the
    /// conformance suite's fixtures ([`crate::fixtures`]).
    pub fixtures: bool,
    /// The most live sandboxes one session may own
    /// (`MOAT_MAX_SANDBOXES_PER_SESSION`); the requests without a session,
    /// which share one scope, may own as many together.
    pub sandboxes_per_session: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("--host {0} is not an IP address; use 127.0.0.1 (the default), ::1 or another address of this machine")]
    NotAnAddress(String),
    #[error(
        "--host {0} would listen on every address, where Host checks cannot protect the server; \
         give the one address clients connect to (127.0.0.1 by default)"
    )]
    Wildcard(IpAddr),
    #[error("Cannot listen on {addr} ({source}); pick another --port or stop what uses it")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("The tools contract does not parse")]
    Contract(#[source] serde_json::Error),
    #[error(
        "Cannot write the generated bearer token to {path} ({why}); set MOAT_HTTP_TOKEN to a secret of 16 or more \
         characters instead, or fix that directory (it must be yours and not writable by others)"
    )]
    TokenFile { path: PathBuf, why: String },
    #[error("An HTTP server needs a bearer token of at least 16 characters (MOAT_HTTP_TOKEN or a generated one)")]
    NoToken,
}

/// The directory generated tokens are written to: `$XDG_RUNTIME_DIR/moat`
/// when the session has a runtime directory of this user's own, else `run/`
/// in moat's data directory. (Root started with a user's environment, by
/// `su` or `sudo -E`, would otherwise write in a directory that user
/// controls.)
pub fn token_dir(data_dir: &Path) -> PathBuf {
    token_dir_in(std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()).map(PathBuf::from), data_dir)
}

fn token_dir_in(runtime: Option<PathBuf>, data_dir: &Path) -> PathBuf {
    let me = nix::unistd::geteuid().as_raw();
    match runtime {
        Some(runtime) if std::fs::metadata(&runtime).is_ok_and(|m| m.is_dir() && m.uid() == me) => runtime.join("moat"),
        _ => data_dir.join("run"),
    }
}

/// The file a server on `port` writes its generated token to.
pub fn token_path(data_dir: &Path, port: u16) -> PathBuf {
    token_dir(data_dir).join(format!("http-{port}.token"))
}

/// A generated token in a file only its owner can read; removed on drop.
#[derive(Debug)]
pub struct TokenFile {
    pub path: PathBuf,
    pub token: String,
    /// The directory it was written in, held: it is removed from there,
    /// wherever that directory's name now leads.
    dir: std::os::fd::OwnedFd,
    name: std::ffi::OsString,
}

impl Drop for TokenFile {
    fn drop(&mut self) {
        let _ = nix::unistd::unlinkat(&self.dir, self.name.as_os_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
    }
}

impl TokenFile {
    /// Generates a token and writes it to `path`: the directory is made
    /// (mode 0700) if missing and must be this user's and writable by no
    /// one else; the file is created with `O_EXCL | O_NOFOLLOW`, mode 0600.
    /// A file left by a server that died is replaced; a link is refused.
    ///
    /// The directory is checked and used through one descriptor (opened
    /// without following a link), never by its path again: whoever owns
    /// the directory above it may rename things there meanwhile.
    pub fn create(path: &Path) -> Result<Self, HttpError> {
        use nix::fcntl::{OFlag, open, openat};
        use nix::sys::stat::{Mode, SFlag, fstat, fstatat};
        let fail = |why: String| HttpError::TokenFile { path: path.to_owned(), why };
        let dir_path = path.parent().ok_or_else(|| fail("it has no directory".into()))?;
        let name = path.file_name().ok_or_else(|| fail("it names no file".into()))?;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir_path).map_err(|e| fail(e.to_string()))?;
        let not_ours =
            || fail(format!("{} is not a directory of this user that only it may write", dir_path.display()));
        let dir =
            open(dir_path, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(|_| not_ours())?;
        let me = nix::unistd::geteuid().as_raw();
        let meta = fstat(&dir).map_err(|e| fail(e.to_string()))?;
        if meta.st_uid != me || meta.st_mode & 0o022 != 0 {
            return Err(not_ours());
        }
        match fstatat(&dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(old) if old.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFREG.bits() && old.st_uid == me => {
                nix::unistd::unlinkat(&dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir)
                    .map_err(|e| fail(format!("removing a stale token file: {e}")))?;
            }
            Ok(_) => return Err(fail("something that is not this user's file is in its place".into())),
            Err(_) => {}
        }
        let token = new_token().map_err(|e| fail(format!("no random bytes from the kernel for a token: {e}")))?;
        let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let file = openat(&dir, name, flags, Mode::from_bits_truncate(0o600)).map_err(|e| fail(e.to_string()))?;
        std::fs::File::from(file).write_all(format!("{token}\n").as_bytes()).map_err(|e| fail(e.to_string()))?;
        Ok(Self { path: path.to_owned(), token, dir, name: name.to_owned() })
    }
}

/// 64 random hex digits.
pub(crate) fn new_token() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Parses `--host`: an IP address that is not a wildcard.
pub fn parse_host(host: &str) -> Result<IpAddr, HttpError> {
    let address = if host == "localhost" { Ok(IpAddr::from([127, 0, 0, 1])) } else { host.parse() };
    let address = address.map_err(|_| HttpError::NotAnAddress(host.to_owned()))?;
    if address.is_unspecified() {
        return Err(HttpError::Wildcard(address));
    }
    Ok(address)
}

/// What the gate checks.
#[derive(Debug)]
struct Gate {
    /// `host:port` as clients must send it.
    authority: String,
    origin: String,
    token: String,
    /// TEST ONLY: cut `test_reconnection`'s stream ([`crate::fixtures`]).
    fixtures: bool,
}

/// A bound server, ready to serve.
#[derive(Debug)]
pub struct HttpServer {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    config: HttpConfig,
}

impl HttpServer {
    pub async fn bind(config: HttpConfig) -> Result<Self, HttpError> {
        let addr = SocketAddr::new(config.host, config.port);
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| HttpError::Bind { addr, source })?;
        let addr = listener.local_addr().map_err(|source| HttpError::Bind { addr, source })?;
        Ok(Self { listener, addr, config })
    }

    /// The server with `token` as the bearer token it requires (for a
    /// token made once the port is known).
    pub fn with_token(mut self, token: String) -> Self {
        self.config.token = token;
        self
    }

    /// The address it listens on (the port resolved when 0 was asked).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The MCP endpoint's URL.
    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// Serves until `shutdown` is cancelled.
    pub async fn serve(self, moat: Moat, defaults: SandboxSpec, shutdown: CancellationToken) -> Result<(), HttpError> {
        if self.config.token.len() < 16 {
            return Err(HttpError::NoToken);
        }
        let authority = self.addr.to_string();
        let origin = format!("http://{authority}");
        let mut tools = crate::contract_tools().map_err(HttpError::Contract)?;
        let fixtures = self.config.fixtures;
        if fixtures {
            tools.extend(crate::fixtures::tools());
        }
        let tools = Arc::new(tools);
        let share = self.config.sandboxes_per_session;
        // Requests without a session (protocol 2026-07-28) share one scope,
        // held together to one session's share: clients that send no
        // session cannot take every place from those that do.
        let sessionless = Arc::new(Scope::new(moat.clone(), false, share));
        // A session idle this long is closed and its sandboxes destroyed;
        // they would have expired by then anyway (none lives longer than
        // the operator grants).
        let keep_alive = Duration::from_secs(defaults.timeout_seconds.max(moat.grants().timeout_seconds));
        let mut sessions = LocalSessionManager::default();
        sessions.session_config.keep_alive = Some(keep_alive);
        // A response that finishes while its client's SSE stream is down is
        // replayed when the client reconnects with Last-Event-ID.
        let sessions = sessions.with_event_store(Arc::new(EventLog::default()));
        let transport = StreamableHttpServerConfig::default()
            .with_allowed_hosts([authority.clone()])
            .with_allowed_origins([origin.clone()])
            .enforce_origin_validation()
            .with_max_request_body_bytes(MAX_MESSAGE_BYTES)
            .with_cancellation_token(shutdown.child_token());
        let service = StreamableHttpService::new(
            move || {
                Ok(MoatServer::for_http(
                    moat.clone(),
                    defaults.clone(),
                    tools.clone(),
                    sessionless.clone(),
                    fixtures,
                    share,
                ))
            },
            Arc::new(sessions),
            transport,
        );
        let gate = Arc::new(Gate { authority, origin, token: self.config.token.clone(), fixtures });
        let app = axum::Router::new()
            .nest_service("/mcp", service)
            .layer(axum::middleware::from_fn_with_state(gate, check_request));
        serve_connections(self.listener, app, shutdown, ConnectionLimits::default()).await;
        Ok(())
    }
}

/// What one connection may take of the server before any request on it
/// is checked (the token included): every local account can open them.
#[derive(Debug, Clone, Copy)]
struct ConnectionLimits {
    /// The most connections served at once. A connection past it closes
    /// the oldest one no request has yet vouched for (carried the token),
    /// else waits until one closes: connections that only ever send heads
    /// without the token hold no place against the server's own client.
    max: usize,
    /// How long a client may take to send a request's head, and a
    /// kept-alive connection may wait for its next request, before it is
    /// closed. A response being streamed (SSE) is not waiting.
    head_timeout: Duration,
    /// The most bytes of a request's head kept while it is read.
    head_bytes: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self { max: 1024, head_timeout: Duration::from_secs(30), head_bytes: 64 * 1024 }
    }
}

/// Serves `app` on `listener` until `shutdown`, then lets the connections
/// finish. Written here rather than with `axum::serve`, which gives hyper
/// no timer (so no header timeout) and caps neither connections nor what a
/// head may buffer: a client trickling one header byte at a time would
/// hold a descriptor and 400 KiB for ever, and enough of them would stop
/// the server for everyone. Nor would they now: at the most connections,
/// a new one closes the oldest that no request has vouched for.
async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    shutdown: CancellationToken,
    limits: ConnectionLimits,
) {
    let places = Places::new(limits.max);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, most likely: wait for some to close.
                    tracing::warn!("accepting an HTTP connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let place = match places.try_take() {
            Some(place) => place,
            None => {
                if places.make_room() {
                    tracing::debug!("closed the oldest connection no request had vouched for, for a new one");
                }
                tokio::select! {
                    place = places.take() => place,
                    () = shutdown.cancelled() => break,
                }
            }
        };
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(limits.head_timeout)
            .max_buf_size(limits.head_bytes);
        let vouched = place.vouched().clone();
        let app = tower::ServiceExt::map_request(
            app.clone(),
            move |mut request: axum::http::Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(vouched.clone());
                request
            },
        );
        let service = hyper_util::service::TowerToHyperService::new(app);
        let connection = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            tokio::select! {
                ended = connection => {
                    if let Err(e) = ended {
                        tracing::debug!("an HTTP connection ended: {e}");
                    }
                }
                // Dropped, the connection closes.
                () = place.closed() => {}
            }
            drop(place);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// The gate in front of the MCP endpoint.
async fn check_request(State(gate): State<Arc<Gate>>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
    if host != gate.authority {
        return refuse(
            StatusCode::FORBIDDEN,
            format!(
                "Host {host:?} is not this server's address; moat-mcp answers only requests for {} \
                 (connect to http://{}/mcp)",
                gate.authority, gate.authority
            ),
        );
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        if origin != gate.origin {
            return refuse(
                StatusCode::FORBIDDEN,
                format!("Origin {origin:?} may not use this server; only pages from {} may", gate.origin),
            );
        }
    }
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("");
    let presented = given.strip_prefix("Bearer ").map(str::trim);
    if !presented.is_some_and(|p| same_secret(p.as_bytes(), gate.token.as_bytes())) {
        let (challenge, message) = match presented {
            None => (
                r#"Bearer realm="moat-mcp""#,
                "this server requires a bearer token: MOAT_HTTP_TOKEN, or the one in the file it named at start",
            ),
            Some(_) => (r#"Bearer realm="moat-mcp", error="invalid_token""#, "the bearer token is not valid"),
        };
        let mut response = refuse(StatusCode::UNAUTHORIZED, format!("Unauthorized: {message}"));
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
        return response;
    }
    if let Some(vouched) = request.extensions().get::<Vouched>() {
        vouched.set();
    }
    // A request that may start a session (or is served without one) while
    // the server keeps as many as it may is refused before anything is made
    // for it. Checked, it holds its place until its session counts itself
    // (past its body, however slowly that comes).
    let _starting = if request.headers().contains_key("mcp-session-id") {
        None
    } else {
        match crate::scope::SESSIONS.start() {
            Some(place) => Some(place),
            None => return session_full(),
        }
    };
    let closing = request.method() == axum::http::Method::DELETE;
    let mut cut = false;
    let request = if request.method() == axum::http::Method::POST {
        match bounded_message(request).await {
            Ok((request, body)) => {
                cut = gate.fixtures && crate::fixtures::is_call_of(&body, crate::fixtures::RECONNECTION);
                request
            }
            Err(answer) => return answer,
        }
    } else {
        request
    };
    let mut response = next.run(request).await;
    if cut {
        response = cut_after_first_event(response);
    }
    // rmcp acknowledges a session's DELETE with 202; the Python SDK
    // expects 200 and warns on anything else. The session is gone either way.
    if closing && response.status() == StatusCode::ACCEPTED {
        *response.status_mut() = StatusCode::OK;
    }
    response
}

/// The 503 for a new session when the server keeps as many as it may
/// ([`crate::scope::MAX_SESSIONS`]).
fn session_full() -> Response {
    let mut response = refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            "moat-mcp serves at most {} sessions at once and has that many; close one (DELETE /mcp with its \
             Mcp-Session-Id) or wait until one ends or expires, then connect again",
            crate::scope::MAX_SESSIONS
        ),
    );
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("10"));
    response
}

/// How much of an oversized body is read to find its id before the
/// answer goes without one (the client is authenticated; this only bounds
/// the time spent on it).
const MAX_SKIPPED_BYTES: usize = 64 * MAX_MESSAGE_BYTES;

/// Reads a POST's body, at most [`MAX_MESSAGE_BYTES`] of it: one over the
/// limit is answered 413 with a JSON-RPC error naming the limit (and the
/// request's id, found while the rest is skipped), one that is not a
/// JSON-RPC message 400 with a JSON-RPC error saying what is wrong.
/// rmcp would answer both in plain text, which clients do not show.
async fn bounded_message(request: Request) -> Result<(Request, bytes::Bytes), Response> {
    use futures_util::StreamExt;
    let (parts, body) = request.into_parts();
    let mut chunks = body.into_data_stream();
    let mut collected = Vec::new();
    let mut skipping: Option<(IdScanner, usize)> = None;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| {
            refuse(
                StatusCode::BAD_REQUEST,
                format!("Bad Request: the request body could not be read ({e}); send it again"),
            )
        })?;
        if let Some((scanner, seen)) = skipping.as_mut() {
            scanner.feed(&chunk);
            *seen = seen.saturating_add(chunk.len());
            if *seen > MAX_SKIPPED_BYTES {
                break;
            }
        } else if collected.len().saturating_add(chunk.len()) > MAX_MESSAGE_BYTES {
            let mut scanner = IdScanner::new();
            scanner.feed(&collected);
            scanner.feed(&chunk);
            skipping = Some((scanner, collected.len() + chunk.len()));
            collected = Vec::new();
        } else {
            collected.extend_from_slice(&chunk);
        }
    }
    if let Some((scanner, seen)) = skipping {
        tracing::warn!(bytes = seen, limit = MAX_MESSAGE_BYTES, "answered a request body over the size limit with 413");
        return Err(json_rpc_answer(StatusCode::PAYLOAD_TOO_LARGE, &too_large_response(scanner.id(), seen)));
    }
    if let Parsed::Reply(answer) = crate::stdio::parse(&collected) {
        return Err(json_rpc_answer(StatusCode::BAD_REQUEST, &answer));
    }
    let body = bytes::Bytes::from(collected);
    Ok((Request::from_parts(parts, axum::body::Body::from(body.clone())), body))
}

/// TEST ONLY (the `test_reconnection` fixture, [`crate::fixtures`]): the
/// response's SSE stream as a client sees it when the server closes it
/// mid-call. Its first event (the priming event, whose id a client resumes
/// from) passes; the rest is read, so that the call finishes and its
/// result is kept in the event log, but not passed on; then the stream
/// ends. The client gets the result by reconnecting with `Last-Event-ID`.
fn cut_after_first_event(response: Response) -> Response {
    use futures_util::StreamExt;
    let (parts, body) = response.into_parts();
    let mut inner = body.into_data_stream();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, axum::Error>>(4);
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while let Some(Ok(chunk)) = inner.next().await {
            seen.extend_from_slice(&chunk);
            if let Some(end) = seen.windows(2).position(|w| w == b"\n\n") {
                let _ = tx.send(Ok(bytes::Bytes::copy_from_slice(&seen[..end + 2]))).await;
                break;
            }
        }
        // `tx` is held until the call's stream ends: the client sees the
        // end only once the result is in the event log.
        while let Some(Ok(_)) = inner.next().await {}
        drop(tx);
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
    Response::from_parts(parts, axum::body::Body::from_stream(stream))
}

fn json_rpc_answer(status: StatusCode, answer: &serde_json::Value) -> Response {
    let mut response = (status, answer.to_string()).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn refuse(status: StatusCode, message: String) -> Response {
    tracing::info!(%status, "refused an HTTP request: {message}");
    let mut response = (status, message).into_response();
    // A refused request's body is left unread, so the server closes the
    // connection after answering: saying so keeps a client from sending
    // its next request down it (the conformance suite's next request
    // failed with "other side closed" when it raced the close).
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Compares secrets in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server of `app` with `limits`, and its address.
    async fn served(limits: ConnectionLimits) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve_connections(listener, app, stop.clone(), limits));
        (addr, stop, task)
    }

    /// Reads what the server sends until it closes the connection (or 10 s).
    async fn until_closed(stream: &mut tokio::net::TcpStream) -> Option<String> {
        use tokio::io::AsyncReadExt;
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut got)).await;
        read.ok().map(|_| String::from_utf8_lossy(&got).into_owned())
    }

    #[tokio::test]
    async fn a_connection_that_sends_no_whole_head_is_closed_and_a_slot_freed() {
        use tokio::io::AsyncWriteExt;
        let limits = ConnectionLimits { max: 2, head_timeout: Duration::from_millis(300), head_bytes: 8192 };
        let (addr, stop, task) = served(limits).await;
        // Two slow clients take both slots: a third waits in the backlog.
        let mut slow = Vec::new();
        for _ in 0..2 {
            let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            stream.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").await.expect("part of a head");
            slow.push(stream);
        }
        // The head timeout closes them, and the third is served.
        for stream in &mut slow {
            assert!(until_closed(stream).await.is_some(), "a trickling head is closed");
        }
        let mut third = tokio::net::TcpStream::connect(addr).await.expect("connect");
        third.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("a request");
        let answer = until_closed(&mut third).await.expect("answered");
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok"), "{answer}");
        // A head larger than the buffer is refused, not buffered.
        let mut big = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!("GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n", "a".repeat(64 * 1024));
        let _ = big.write_all(head.as_bytes()).await;
        let answer = until_closed(&mut big).await.unwrap_or_default();
        assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), task).await.expect("stops").expect("ends");
    }

    /// Connections that never carry the token hold no place against the
    /// server's client: at the most connections, a new one closes the
    /// oldest that no request vouched for; one that did is never closed.
    #[tokio::test]
    async fn strangers_holding_every_connection_make_room_and_vouched_ones_keep_theirs() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let limits = ConnectionLimits { max: 2, head_timeout: Duration::from_secs(3600), head_bytes: 8192 };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        // What check_request does once the token checks out.
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" })).layer(
            axum::middleware::from_fn(|request: Request, next: Next| async move {
                if request.headers().contains_key("x-token")
                    && let Some(vouched) = request.extensions().get::<Vouched>()
                {
                    vouched.set();
                }
                next.run(request).await
            }),
        );
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve_connections(listener, app, stop.clone(), limits));
        let ask =
            |token: bool| format!("GET / HTTP/1.1\r\nHost: x\r\n{}\r\n", if token { "X-Token: 1\r\n" } else { "" });
        async fn answer(stream: &mut tokio::net::TcpStream, request: &str) -> String {
            stream.write_all(request.as_bytes()).await.expect("a request");
            let mut got = vec![0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut got))
                .await
                .expect("answered, not left waiting")
                .expect("read");
            String::from_utf8_lossy(&got[..n]).into_owned()
        }
        // Two strangers take both places and send nothing.
        let mut strangers = Vec::new();
        for _ in 0..2 {
            strangers.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The client gets a place at once: the oldest stranger is closed.
        let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        assert!(answer(&mut client, &ask(true)).await.starts_with("HTTP/1.1 200"));
        assert_eq!(until_closed(&mut strangers[0]).await.as_deref(), Some(""), "the oldest stranger is closed");
        // A second client connection, vouched for too: both places are
        // the client's, and a stranger neither closes them nor is served.
        let mut second = tokio::net::TcpStream::connect(addr).await.expect("connect");
        assert!(answer(&mut second, &ask(true)).await.starts_with("HTTP/1.1 200"));
        let mut late = tokio::net::TcpStream::connect(addr).await.expect("connect");
        late.write_all(ask(false).as_bytes()).await.expect("a request");
        for stream in [&mut client, &mut second] {
            assert!(answer(stream, &ask(false)).await.starts_with("HTTP/1.1 200"), "a vouched connection stays");
        }
        let mut nothing = [0u8; 1];
        let waited = tokio::time::timeout(Duration::from_millis(300), late.read(&mut nothing)).await;
        assert!(waited.is_err(), "a stranger past the most waits for a place");
        // A place freed, it is served.
        drop(client);
        let mut got = vec![0u8; 4096];
        let n =
            tokio::time::timeout(Duration::from_secs(30), late.read(&mut got)).await.expect("served").expect("read");
        assert!(String::from_utf8_lossy(&got[..n]).starts_with("HTTP/1.1 200"));
        stop.cancel();
        drop((strangers, second, late));
        tokio::time::timeout(Duration::from_secs(10), task).await.expect("stops").expect("ends");
    }

    #[test]
    fn a_session_past_the_most_is_refused_with_when_to_retry() {
        let full = session_full();
        assert_eq!(full.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(full.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()), Some("10"));
    }

    #[test]
    fn hosts_are_single_addresses() {
        assert_eq!(parse_host("127.0.0.1").expect("loopback"), IpAddr::from([127, 0, 0, 1]));
        assert_eq!(parse_host("localhost").expect("localhost"), IpAddr::from([127, 0, 0, 1]));
        let wildcard = parse_host("0.0.0.0").expect_err("wildcard").to_string();
        assert!(wildcard.contains("every address"), "{wildcard}");
        assert!(matches!(parse_host("::"), Err(HttpError::Wildcard(_))));
        assert!(matches!(parse_host("example.com"), Err(HttpError::NotAnAddress(_))));
    }

    #[test]
    fn generated_tokens_are_for_the_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("run/http-8000.token");
        let file = TokenFile::create(&path).expect("written");
        assert_eq!(file.token.len(), 64);
        let meta = std::fs::symlink_metadata(&path).expect("exists");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(dir.path().join("run")).expect("dir").permissions().mode() & 0o777, 0o700);
        assert_eq!(std::fs::read_to_string(&path).expect("read").trim(), file.token);
        let first = file.token.clone();
        // A file a dead server left is replaced, with a new token.
        std::mem::forget(file);
        let again = TokenFile::create(&path).expect("replaced");
        assert_ne!(again.token, first);
        drop(again);
        assert!(!path.exists(), "removed with the server");

        // A link in its place is never followed.
        let target = dir.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, &path).expect("link");
        let err = TokenFile::create(&path).expect_err("a link").to_string();
        assert!(err.contains("MOAT_HTTP_TOKEN") && !target.exists(), "{err}");
        std::fs::remove_file(&path).expect("unlink");

        // A directory others may write is refused.
        std::fs::set_permissions(dir.path().join("run"), std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(TokenFile::create(&path).is_err());

        // A link in the directory's place is not followed either.
        let theirs = dir.path().join("theirs");
        std::fs::create_dir(&theirs).expect("mkdir");
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        std::os::unix::fs::symlink(&theirs, dir.path().join("linked")).expect("link");
        let through = dir.path().join("linked/http-8000.token");
        let err = TokenFile::create(&through).expect_err("a linked directory").to_string();
        assert!(err.contains("not a directory of this user"), "{err}");
        assert_eq!(std::fs::read_dir(&theirs).expect("ls").count(), 0, "written through the link");

        // A runtime directory of another user's is not used.
        let data = dir.path().join("data");
        assert_eq!(token_dir_in(Some(dir.path().to_owned()), &data), dir.path().join("moat"));
        if std::os::unix::fs::chown(&theirs, Some(4242), Some(4242)).is_ok() {
            assert_eq!(token_dir_in(Some(theirs.clone()), &data), data.join("run"), "another user's runtime directory");
        }
        assert_eq!(token_dir_in(None, &data), data.join("run"));
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
    }
}
