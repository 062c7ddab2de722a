//! `preview_link`: a link to a sandbox port, guarded by a one-time token
//! (on the loopback, or where moat-mcp serves remote clients).

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use super::{CallContext, Outcome, RichOutcome, SandboxRef, Session, Tool, plain, rfc3339};

/// The arguments of `preview_link`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct PreviewLink {
    /// Port 0 is no port a server listens on.
    #[schemars(range(min = 1))]
    port: u16,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for PreviewLink {
    const NAME: &'static str = "preview_link";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(preview_link(server, self).await)
    }
}

async fn preview_link(server: &Session<'_>, args: PreviewLink) -> Outcome {
    let id = args.sandbox.resolve(server).await?;
    let link = server.moat.preview_link(&id, args.port).await?;
    Ok(json!({ "url": link.url, "port": link.port, "token": link.token, "expires_at": rfc3339(link.expires_at) }))
}
