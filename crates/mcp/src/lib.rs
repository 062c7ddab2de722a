//! The MCP server of moat: the tools contract in `testdata/tools.json`
//! mapped onto `moat-core`, served with `rmcp` over stdio or streamable
//! HTTP ([`http`]). Every message gets an answer: one over the size limit
//! or malformed included ([`limits`], [`stdio`]).
//!
//! `tools/list` answers with the contract itself, so what clients see is
//! exactly what `testdata/tools.json` says. Each stdio connection or HTTP
//! session owns its sandboxes ([`scope`]); tools without a `sandbox_id` use
//! the session's current one, created with the defaults on first need.
//! Each tool's arguments are a Rust type (module `tools`), checked against the
//! schema derived from it, which a unit test holds equal to the contract.
//! `git_clone` clones through the sandbox's network policy with
//! credentials kept out of every command line and output; `preview_link`
//! hands out token-guarded loopback links to sandbox ports.

mod advice;
mod arguments;
pub mod config;
pub mod event_log;
pub mod fixtures;
pub mod hosts;
pub mod http;
pub mod limits;
#[cfg(test)]
mod property_tests;
pub mod scope;
pub mod stdio;
mod tools;

pub use config::{ConfigError, ServerConfig};

use std::sync::Arc;

use moat_core::Moat;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, Implementation, InitializeResult, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use scope::Scope;

/// The tools contract, compiled in.
pub const CONTRACT: &str = include_str!("../../../testdata/tools.json");

/// The tools of the contract, as `tools/list` returns them.
pub fn contract_tools() -> Result<Vec<Tool>, serde_json::Error> {
    #[derive(serde::Deserialize)]
    struct Contract {
        tools: Vec<Tool>,
    }
    Ok(serde_json::from_str::<Contract>(CONTRACT)?.tools)
}

/// One MCP connection (stdio) or HTTP session: a `Moat`, and the scope
/// that owns the sandboxes made through it.
#[derive(Clone)]
pub struct MoatServer {
    moat: Moat,
    tools: Arc<Vec<Tool>>,
    /// The spec of sandboxes made without arguments (from the environment).
    defaults: moat_core::SandboxSpec,
    /// This connection's or session's own sandboxes.
    own: Arc<Scope>,
    /// Over HTTP, the scope of requests that carry no session (protocol
    /// 2026-07-28 has none): one shared by all of them.
    sessionless: Option<Arc<Scope>>,
    /// TEST ONLY: serves the conformance suite's fixtures ([`fixtures`]).
    fixtures: bool,
}

impl std::fmt::Debug for MoatServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoatServer").field("tools", &self.tools.len()).finish_non_exhaustive()
    }
}

impl MoatServer {
    /// The server of a stdio connection: it sees every task record.
    pub fn new(moat: Moat, defaults: moat_core::SandboxSpec) -> Result<Self, serde_json::Error> {
        // The server's only client: its share is every place the Moat has.
        let own = Arc::new(Scope::new(moat.clone(), true, usize::MAX));
        Ok(Self { moat, tools: Arc::new(contract_tools()?), defaults, own, sessionless: None, fixtures: false })
    }

    /// The server of one HTTP session (or of one sessionless request);
    /// `fixtures`: `tools` lists the conformance fixtures, which it serves;
    /// the session may own at most `sandboxes_per_session` live sandboxes.
    pub fn for_http(
        moat: Moat,
        defaults: moat_core::SandboxSpec,
        tools: Arc<Vec<Tool>>,
        sessionless: Arc<Scope>,
        fixtures: bool,
        sandboxes_per_session: usize,
    ) -> Self {
        let own = Arc::new(Scope::counted(moat.clone(), sandboxes_per_session));
        Self { moat, tools, defaults, own, sessionless: Some(sessionless), fixtures }
    }

    pub fn moat(&self) -> &Moat {
        &self.moat
    }
}

/// The error for a request of `method` that is not one moat-mcp serves
/// (-32601, which streamable HTTP of 2026-07-28 turns into a 404), or a
/// `tools/call` whose params do not have the shape the specification gives.
fn unknown_request(method: &str) -> McpError {
    match method {
        "tools/call" => McpError::invalid_params(
            "Invalid params for tools/call: give {\"name\": a tool's name, \"arguments\": an object of its \
             arguments}; tools/list shows each tool's inputSchema",
            None,
        ),
        _ => McpError::new(
            rmcp::model::ErrorCode::METHOD_NOT_FOUND,
            format!(
                "Method not found: {:?} (or not in this protocol version); moat-mcp offers tools only: tools/list \
                 and tools/call, after initialize (or server/discover from protocol 2026-07-28), and ping",
                method.chars().take(100).collect::<String>()
            ),
            None,
        ),
    }
}

impl ServerHandler for MoatServer {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("moat", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Disposable, isolated Linux sandboxes (Debian with Python, Node.js, git and build tools). \
                 Tools act on the session's current sandbox unless given a sandbox_id; one is created on first need.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult { tools: self.tools.as_ref().clone(), ..Default::default() })
    }

    /// Requests rmcp could not type: unknown methods, and known ones whose
    /// params have the wrong shape (rmcp's own answer names only the method).
    async fn on_custom_request(
        &self,
        request: rmcp::model::CustomRequest,
        _context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::CustomResult, McpError> {
        Err(unknown_request(&request.method))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        if self.fixtures && fixtures::is_fixture(&request.name) {
            return fixtures::call(&request.name, &context).map(Into::into);
        }
        if !self.tools.iter().any(|t| t.name == request.name) {
            let known: Vec<&str> = self.tools.iter().map(|t| t.name.as_ref()).collect();
            return Err(McpError::invalid_params(
                format!("unknown tool {:?}; the tools are: {}", request.name, known.join(", ")),
                None,
            ));
        }
        let args = serde_json::Value::Object(request.arguments.unwrap_or_default());
        let parts = context.extensions.get::<::http::request::Parts>();
        let scope = match (parts, &self.sessionless) {
            (Some(parts), Some(shared)) if !parts.headers.contains_key("mcp-session-id") => shared.clone(),
            _ => self.own.clone(),
        };
        let session = tools::Session { moat: &self.moat, defaults: &self.defaults, scope };
        let call = tools::CallContext {
            progress: context.meta.get_progress_token(),
            cancelled: context.ct.clone(),
            peer: context.peer.clone(),
        };
        Ok(tools::call(&session, &request.name, args, &call).await.into())
    }
}
