//! Streamable HTTP at `/mcp` (`moat-mcp --http`).
//!
//! The transport itself is rmcp's `StreamableHttpService`, mounted in an
//! axum router behind one gate that every request passes:
//!
//! - `Host` must be exactly the address the server listens on, and a
//!   browser's `Origin` exactly `http://` + that address, so a web page
//!   cannot reach the server through DNS rebinding;
//! - with a token configured (`MOAT_HTTP_TOKEN`), `Authorization: Bearer
//!   <token>` is required (401 with `WWW-Authenticate` otherwise).
//!
//! Each MCP session gets its own [`MoatServer`] and so its own [`Scope`]:
//! sessions cannot see each other's sandboxes, and a session's sandboxes
//! are destroyed when it closes or expires. Requests without a session
//! (protocol 2026-07-28 has no sessions) share one scope of their own.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use moat_core::{Moat, SandboxSpec};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_util::sync::CancellationToken;

use crate::MoatServer;
use crate::scope::Scope;

/// Where and how `moat-mcp --http` serves.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub host: IpAddr,
    /// 0 picks a free port (the URL is printed on stderr).
    pub port: u16,
    /// The bearer token every request must carry, when set.
    pub token: Option<String>,
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
    #[error("The HTTP server failed")]
    Serve(#[source] std::io::Error),
    #[error("The tools contract does not parse")]
    Contract(#[source] serde_json::Error),
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
    token: Option<String>,
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
        let authority = self.addr.to_string();
        let origin = format!("http://{authority}");
        let tools = Arc::new(crate::contract_tools().map_err(HttpError::Contract)?);
        let sessionless = Arc::new(Scope::new(moat.clone(), false));
        // A session idle this long is closed and its sandboxes destroyed;
        // they would have expired by then anyway.
        let keep_alive = Duration::from_secs(defaults.timeout_seconds);
        let mut sessions = LocalSessionManager::default();
        sessions.session_config.keep_alive = Some(keep_alive);
        let transport = StreamableHttpServerConfig::default()
            .with_allowed_hosts([authority.clone()])
            .with_allowed_origins([origin.clone()])
            .enforce_origin_validation()
            .with_cancellation_token(shutdown.child_token());
        let service = StreamableHttpService::new(
            move || Ok(MoatServer::for_http(moat.clone(), defaults.clone(), tools.clone(), sessionless.clone())),
            Arc::new(sessions),
            transport,
        );
        let gate = Arc::new(Gate { authority, origin, token: self.config.token.clone() });
        let app = axum::Router::new()
            .nest_service("/mcp", service)
            .layer(axum::middleware::from_fn_with_state(gate, check_request));
        axum::serve(self.listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
            .map_err(HttpError::Serve)
    }
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
    if let Some(token) = &gate.token {
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("");
        let presented = given.strip_prefix("Bearer ").map(str::trim);
        if !presented.is_some_and(|p| same_secret(p.as_bytes(), token.as_bytes())) {
            let (challenge, message) = match presented {
                None => (r#"Bearer realm="moat-mcp""#, "this server requires a bearer token (MOAT_HTTP_TOKEN)"),
                Some(_) => (r#"Bearer realm="moat-mcp", error="invalid_token""#, "the bearer token is not valid"),
            };
            let mut response = refuse(StatusCode::UNAUTHORIZED, format!("Unauthorized: {message}"));
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
            return response;
        }
    }
    let closing = request.method() == axum::http::Method::DELETE;
    let mut response = next.run(request).await;
    // rmcp acknowledges a session's DELETE with 202; the Python SDK
    // expects 200 and warns on anything else. The session is gone either way.
    if closing && response.status() == StatusCode::ACCEPTED {
        *response.status_mut() = StatusCode::OK;
    }
    response
}

fn refuse(status: StatusCode, message: String) -> Response {
    tracing::info!(%status, "refused an HTTP request: {message}");
    (status, message).into_response()
}

/// Compares secrets in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
    }
}
