//! `copy_to_sandbox` and `copy_from_sandbox`: trees between the host
//! (beneath the operator's `MOAT_ROOTS`, which core enforces) and a
//! sandbox.

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use super::{CallContext, Outcome, RichOutcome, SandboxRef, Session, Tool, plain, sandbox_path};

/// The arguments of `copy_to_sandbox`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct CopyToSandbox {
    host_path: String,
    sandbox_path: String,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for CopyToSandbox {
    const NAME: &'static str = "copy_to_sandbox";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(copy_to_sandbox(server, self).await)
    }
}

/// The arguments of `copy_from_sandbox`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct CopyFromSandbox {
    sandbox_path: String,
    host_path: String,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for CopyFromSandbox {
    const NAME: &'static str = "copy_from_sandbox";

    async fn run(self, server: &Session<'_>, _context: &CallContext) -> RichOutcome {
        plain(copy_from_sandbox(server, self).await)
    }
}

async fn copy_to_sandbox(server: &Session<'_>, args: CopyToSandbox) -> Outcome {
    let host = std::path::PathBuf::from(args.host_path);
    let dest = sandbox_path(&args.sandbox_path);
    let id = args.sandbox.resolve(server).await?;
    let copied = server.moat.copy_to_sandbox(&id, &host, &dest).await?;
    Ok(json!({ "files": copied.files, "bytes": copied.bytes, "skipped": copied.skipped }))
}

async fn copy_from_sandbox(server: &Session<'_>, args: CopyFromSandbox) -> Outcome {
    let source = sandbox_path(&args.sandbox_path);
    let host = std::path::PathBuf::from(args.host_path);
    let id = args.sandbox.resolve(server).await?;
    let copied = server.moat.copy_from_sandbox(&id, &source, &host).await?;
    Ok(json!({ "files": copied.files, "bytes": copied.bytes, "skipped": copied.skipped }))
}
