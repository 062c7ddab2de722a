//! The MCP server of moat: the tools contract in `testdata/tools.json`
//! mapped onto `moat-core`, served with `rmcp` over stdio or streamable
//! HTTP ([`http`]).
//!
//! `tools/list` answers with the contract itself, so what clients see is
//! exactly what `testdata/tools.json` says. Each stdio connection or HTTP
//! session owns its sandboxes ([`scope`]); tools without a `sandbox_id` use
//! the session's current one, created with the defaults on first need.
//! `git_clone` ([`git`]) clones through the sandbox's network policy with
//! credentials kept out of every command line and output; `preview_link`
//! hands out token-guarded loopback links to sandbox ports.

pub mod config;
mod git;
pub mod hosts;
pub mod http;
pub mod scope;
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
}

impl std::fmt::Debug for MoatServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoatServer").field("tools", &self.tools.len()).finish_non_exhaustive()
    }
}

impl MoatServer {
    /// The server of a stdio connection: it sees every task record.
    pub fn new(moat: Moat, defaults: moat_core::SandboxSpec) -> Result<Self, serde_json::Error> {
        let own = Arc::new(Scope::new(moat.clone(), true));
        Ok(Self { moat, tools: Arc::new(contract_tools()?), defaults, own, sessionless: None })
    }

    /// The server of one HTTP session (or of one sessionless request).
    pub fn for_http(
        moat: Moat,
        defaults: moat_core::SandboxSpec,
        tools: Arc<Vec<Tool>>,
        sessionless: Arc<Scope>,
    ) -> Self {
        let own = Arc::new(Scope::new(moat.clone(), false));
        Self { moat, tools, defaults, own, sessionless: Some(sessionless) }
    }

    pub fn moat(&self) -> &Moat {
        &self.moat
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

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
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
