//! The tools. Each tool of the contract is a Rust type of its arguments
//! (read with `serde`, stated with `schemars`) that implements [`Tool`];
//! [`HANDLERS`] lists them all, and a unit test holds that list and the
//! types' schemas to `testdata/tools.json` ([`schema`]). A call's arguments
//! are checked against its tool's schema ([`crate::arguments`]) and then
//! read into the type, so a handler gets its arguments typed and in range.
//! Mistakes the model can fix are tool results with `isError: true` and a
//! message saying what to do.
//!
//! One file per group of tools: [`sandboxes`], [`exec`] (commands and
//! code), [`files`], [`transfer`] (host copies), [`tasks`], [`git`],
//! [`preview`].

mod exec;
mod files;
mod git;
mod preview;
mod sandboxes;
pub(crate) mod schema;
mod tasks;
mod transfer;

use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;

use moat_core::{CopyError, CoreError, CreateError, SandboxError, SandboxSpec, TaskError};
use rmcp::model::{CallToolResult, ContentBlock, ProgressToken};
use rmcp::{Peer, RoleServer};
use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::scope::Scope;

/// Text outputs are cut here, with the full output kept in the sandbox.
pub const MAX_TEXT: usize = 100_000;

/// A tool's failure, shown to the model.
#[derive(Debug)]
pub(crate) struct ToolError(pub(crate) String);

impl From<CoreError> for ToolError {
    fn from(e: CoreError) -> Self {
        // Core's words for an unknown id list every live sandbox or task
        // in progress, other sessions' too: a session is told of its own.
        match &e {
            CoreError::Sandbox(SandboxError::UnknownSandbox { id, .. })
            | CoreError::Task(moat_core::TaskError::Sandbox(SandboxError::UnknownSandbox { id, .. })) => {
                return Self(format!(
                    "No sandbox {id:?}: it has ended; create another with create_sandbox (list_sandboxes shows \
                     this session's)"
                ));
            }
            CoreError::Task(moat_core::TaskError::UnknownTask { id, .. }) => {
                return Self(format!(
                    "No task {id:?} in progress: a task ends with its sandbox (finished, destroyed, expired or \
                     failed); list_sandboxes shows this session's tasks and records"
                ));
            }
            _ => {}
        }
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        Self(crate::advice::advise(&e, message))
    }
}

/// Each operation's error is shown as [`CoreError`] is.
macro_rules! from_operation_error {
    ($($error:ty),*) => {$(
        impl From<$error> for ToolError {
            fn from(e: $error) -> Self {
                CoreError::from(e).into()
            }
        }
    )*};
}

from_operation_error!(CreateError, SandboxError, CopyError, TaskError);

impl From<moat_proto::ProtoError> for ToolError {
    fn from(e: moat_proto::ProtoError) -> Self {
        Self(e.to_string())
    }
}

pub(crate) type Outcome = Result<Value, ToolError>;

/// A result with content beyond its JSON (run_code's images).
pub(crate) type RichOutcome = Result<(Value, Vec<ContentBlock>), ToolError>;

/// What a tool acts with: the server's `Moat`, the default spec, and the
/// scope (stdio connection or HTTP session) that owns its sandboxes.
pub(crate) struct Session<'a> {
    pub moat: &'a moat_core::Moat,
    pub defaults: &'a SandboxSpec,
    pub scope: std::sync::Arc<Scope>,
}

/// What a call knows of its request: progress token, cancellation, peer.
pub struct CallContext {
    pub progress: Option<ProgressToken>,
    pub cancelled: tokio_util::sync::CancellationToken,
    pub peer: Peer<RoleServer>,
}

/// A tool of the contract: its arguments, and what it does with them.
pub(crate) trait Tool: DeserializeOwned + JsonSchema + Send + 'static {
    /// The tool's name in the contract.
    const NAME: &'static str;

    /// Runs the tool on `server` with these arguments.
    fn run(self, server: &Session<'_>, context: &CallContext) -> impl Future<Output = RichOutcome> + Send;
}

/// A plain JSON result, with no content beside it.
fn plain(outcome: Outcome) -> RichOutcome {
    outcome.map(|value| (value, Vec::new()))
}

type Call =
    for<'a> fn(&'a Session<'a>, Value, &'a CallContext) -> Pin<Box<dyn Future<Output = RichOutcome> + Send + 'a>>;

/// One entry of [`HANDLERS`]: a tool's name, the schema of its arguments
/// derived from their type, and the call that reads them and runs it.
pub(crate) struct Handler {
    pub name: &'static str,
    pub schema: fn() -> Map<String, Value>,
    call: Call,
    /// Reads arguments into the tool's type and drops them: tests hold
    /// the argument check and the types to each other with it.
    #[cfg(test)]
    pub read: fn(Value) -> Result<(), String>,
}

const fn handler<T: Tool>() -> Handler {
    Handler {
        name: T::NAME,
        schema: schema::input_schema::<T>,
        call: call_with::<T>,
        #[cfg(test)]
        read: |args| T::deserialize(args).map(drop).map_err(|e| e.to_string()),
    }
}

/// Reads `args` as `T` and runs it. The arguments passed their check
/// against `T`'s own schema, so reading them fails only if the schema
/// and the type disagree; the message still says what was wrong.
fn call_with<'a, T: Tool>(
    server: &'a Session<'a>,
    args: Value,
    context: &'a CallContext,
) -> Pin<Box<dyn Future<Output = RichOutcome> + Send + 'a>> {
    Box::pin(async move {
        let args = T::deserialize(args).map_err(|e| ToolError(format!("Invalid arguments: {e}")))?;
        args.run(server, context).await
    })
}

/// Every tool, in the contract's order. A tool of the contract missing
/// here (or one here that the contract lacks) fails the unit test
/// `schema::tests::every_tool_of_the_contract_has_a_handler`.
pub(crate) const HANDLERS: &[Handler] = &[
    handler::<sandboxes::CreateSandbox>(),
    handler::<sandboxes::DestroySandbox>(),
    handler::<sandboxes::ListSandboxes>(),
    handler::<exec::RunCommand>(),
    handler::<exec::RunCode>(),
    handler::<files::ReadFile>(),
    handler::<files::WriteFile>(),
    handler::<files::ListFiles>(),
    handler::<files::MakeDir>(),
    handler::<files::MoveFile>(),
    handler::<files::DeleteFile>(),
    handler::<transfer::CopyToSandbox>(),
    handler::<transfer::CopyFromSandbox>(),
    handler::<git::GitClone>(),
    handler::<preview::PreviewLink>(),
    handler::<tasks::TaskStart>(),
    handler::<tasks::TaskDiff>(),
    handler::<tasks::TaskFinish>(),
    handler::<tasks::RemoveTask>(),
];

/// Each handler's input schema, derived once.
pub(crate) static SCHEMAS: LazyLock<Vec<Map<String, Value>>> =
    LazyLock::new(|| HANDLERS.iter().map(|h| (h.schema)()).collect());

/// Runs tool `name`; always a result, errors included.
pub async fn call(server: &Session<'_>, name: &str, args: Value, context: &CallContext) -> CallToolResult {
    let Some(index) = HANDLERS.iter().position(|h| h.name == name) else {
        return CallToolResult::error(vec![ContentBlock::text(format!(
            "{name} is not available in this build of moat-mcp yet"
        ))]);
    };
    if let Err(mistake) = crate::arguments::check(name, &SCHEMAS[index], &args) {
        return CallToolResult::error(vec![ContentBlock::text(format!("Invalid arguments: {mistake}"))]);
    }
    let scope = server.scope.clone();
    let _running = match scope.admit_call().and_then(|own| Ok((own, crate::scope::SERVER_CALLS.admit()?))) {
        Ok(permits) => permits,
        Err(busy) => return CallToolResult::error(vec![ContentBlock::text(busy)]),
    };
    match (HANDLERS[index].call)(server, args, context).await {
        Ok((value, extra)) => {
            let text = serde_json::to_string_pretty(&value).unwrap_or_default();
            let mut content = vec![ContentBlock::text(text)];
            content.extend(extra);
            let mut result = CallToolResult::success(content);
            result.structured_content = Some(value);
            result
        }
        Err(ToolError(message)) => {
            CallToolResult::error(vec![ContentBlock::text(error_text(&hide_private_paths(&message, server.moat)))])
        }
    }
}

/// The longest error text a tool result carries, in characters.
pub const MAX_ERROR_TEXT: usize = 16 * 1024;

/// An error as the model is shown it. Parts of many errors come from the
/// sandbox (the agent's own messages, a command's stderr, a microVM's
/// console): they are cut to [`MAX_ERROR_TEXT`], and control characters
/// other than newlines and tabs (terminal escapes) are shown as `\u{…}`
/// escapes instead of passed on.
fn error_text(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_ERROR_TEXT));
    let mut written = 0;
    for (count, c) in message.chars().enumerate() {
        let escaped = c.is_control() && c != '\n' && c != '\t';
        let width = if escaped { c.escape_unicode().len() } else { 1 };
        if written + width > MAX_ERROR_TEXT {
            let rest = message.chars().count() - count;
            out.push_str(&format!("… [{rest} more characters cut]"));
            break;
        }
        written += width;
        if escaped {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

/// `message` with moat's own host paths ([`moat_core::Moat::private_paths`]:
/// data directory, binaries, cgroups) replaced by words: errors from deep
/// inside (a backend that could not start, an image that is missing) must
/// not show the model where things live on the host.
pub(crate) fn hide_private_paths(message: &str, moat: &moat_core::Moat) -> String {
    hide_paths(message, &moat.private_paths())
}

/// `message` with each of `paths` (longest first) replaced by its words.
fn hide_paths(message: &str, paths: &[(String, &str)]) -> String {
    paths.iter().fold(message.to_owned(), |text, (path, label)| text.replace(path.as_str(), label))
}

/// The sandbox a tool acts on, an argument shared by most tools.
#[derive(Debug, Deserialize, JsonSchema)]
pub(crate) struct SandboxRef {
    /// Sandbox id from create_sandbox or list_sandboxes. Omit to use this
    /// session's current sandbox (created with the defaults on first need).
    sandbox_id: Option<String>,
}

impl SandboxRef {
    /// The sandbox's id: `sandbox_id`, or the session's current one,
    /// created with the defaults when there is none.
    pub(crate) async fn resolve(&self, server: &Session<'_>) -> Result<String, ToolError> {
        if let Some(id) = &self.sandbox_id {
            owned(server, id)?;
            return Ok(id.clone());
        }
        if let Some(id) = server.scope.current()
            && server.moat.get(&id).is_ok()
        {
            return Ok(id);
        }
        let place = server.scope.reserve_sandbox().map_err(ToolError)?;
        let sandbox = server.moat.create(server.defaults.clone()).await?;
        place.adopt(&sandbox.id, true);
        Ok(sandbox.id)
    }
}

/// Paths relative to the user's home are taken as inside it.
fn sandbox_path(path: &str) -> String {
    if path.starts_with('/') { path.to_owned() } else { format!("/home/user/{path}") }
}

/// The latest time RFC 3339 can write: 9999-12-31T23:59:59Z.
const LAST_RFC3339: u64 = 253_402_300_799;

/// `secs` after the epoch in RFC 3339. A time from a sandbox (a file's
/// mtime) may be anything its processes set: later than the format's last
/// year it is written as that year's end (humantime's `Display` fails
/// there, and `to_string` would panic).
pub(crate) fn rfc3339(secs: u64) -> String {
    let time = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs.min(LAST_RFC3339));
    humantime::format_rfc3339_seconds(time).to_string()
}

/// Checks that sandbox `id` is this session's and still alive.
fn owned(server: &Session<'_>, id: &str) -> Result<(), ToolError> {
    in_scope(server, id)?;
    server.moat.get(id).map(drop).map_err(|e| {
        // A failed sandbox stays listed (and in scope) until destroyed.
        if !matches!(e, SandboxError::Failed { .. }) {
            server.scope.forget(id);
        }
        e.into()
    })
}

/// Checks that sandbox `id` is this session's.
fn in_scope(server: &Session<'_>, id: &str) -> Result<(), ToolError> {
    if !server.scope.owns(id) {
        let mine = server.scope.sandboxes();
        let mine = if mine.is_empty() { "none".to_owned() } else { mine.join(", ") };
        return Err(ToolError(format!(
            "No sandbox {id:?} in this session; this session's sandboxes: {mine} (see list_sandboxes, or create one with create_sandbox)"
        )));
    }
    Ok(())
}

/// Cuts `text` at [`MAX_TEXT`] characters with a note of what was left out.
fn clip(text: &str) -> (String, bool) {
    match text.char_indices().nth(MAX_TEXT) {
        None => (text.to_owned(), false),
        Some((cut, _)) => {
            let rest = text[cut..].chars().count();
            (format!("{}… [truncated: {rest} more characters]", &text[..cut]), true)
        }
    }
}

fn rand_u32() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_texts_are_cut_and_show_no_control_characters() {
        assert_eq!(error_text("plain\n\ttext"), "plain\n\ttext");
        assert_eq!(error_text("red \x1b[31mtext\x1b[0m\r"), "red \\u{1b}[31mtext\\u{1b}[0m\\u{d}");
        let long = "é".repeat(MAX_ERROR_TEXT + 10);
        let cut = error_text(&long);
        assert!(cut.ends_with("… [10 more characters cut]") && cut.chars().count() < MAX_ERROR_TEXT + 40, "{cut}");
        let escapes = error_text(&"\x1b".repeat(MAX_ERROR_TEXT));
        assert!(escapes.chars().count() < MAX_ERROR_TEXT + 40, "escapes count as what they show");
    }

    #[test]
    fn any_time_a_sandbox_sets_is_written() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(LAST_RFC3339), "9999-12-31T23:59:59Z");
        for far in [LAST_RFC3339 + 1, 300_000_000_000, i64::MAX as u64, u64::MAX] {
            assert_eq!(rfc3339(far), "9999-12-31T23:59:59Z", "{far}");
        }
    }

    #[test]
    fn long_text_is_clipped_with_a_count() {
        let long = "é".repeat(MAX_TEXT + 5);
        let (text, cut) = clip(&long);
        assert!(cut);
        assert!(text.ends_with("… [truncated: 5 more characters]"), "{}", &text[text.len() - 40..]);
        assert_eq!(clip("short"), ("short".to_owned(), false));
    }

    #[test]
    fn private_host_paths_are_replaced_by_words() {
        let paths =
            [("/srv/moat-data/images".to_owned(), "<images>"), ("/srv/moat-data".to_owned(), "<moat data directory>")];
        let message =
            "Image \"x\" is corrupt: /srv/moat-data/images/x/rootfs.ext4 is short; state in /srv/moat-data/sandboxes";
        let hidden = hide_paths(message, &paths);
        assert!(!hidden.contains("/srv/moat-data"), "{hidden}");
        assert!(
            hidden.contains("<images>/x/rootfs.ext4") && hidden.contains("<moat data directory>/sandboxes"),
            "{hidden}"
        );
    }
}
