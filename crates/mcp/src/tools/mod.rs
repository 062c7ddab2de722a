//! The tools: arguments checked, mapped onto `moat-core`, results shaped as
//! the contract says. Mistakes the model can fix are tool results with
//! `isError: true` and a message saying what to do.

use std::time::Duration;

use base64::Engine;
use moat_core::{CoreError, Language, NetworkPolicy, SandboxSpec};
use moat_proto::{ExecRequest, FileKind, ReadFileRequest, WriteFileRequest};
use rmcp::model::{CallToolResult, ContentBlock, ProgressNotificationParam, ProgressToken, ResourceContents};
use rmcp::{Peer, RoleServer};
use serde_json::{Value, json};

use crate::scope::Scope;

/// Text outputs are cut here, with the full output kept in the sandbox.
pub const MAX_TEXT: usize = 100_000;

/// A tool's failure, shown to the model.
pub(crate) struct ToolError(pub(crate) String);

impl From<CoreError> for ToolError {
    fn from(e: CoreError) -> Self {
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        Self(message)
    }
}

impl From<moat_proto::ProtoError> for ToolError {
    fn from(e: moat_proto::ProtoError) -> Self {
        Self(e.to_string())
    }
}

pub(crate) type Outcome = Result<Value, ToolError>;

/// A result with content beyond its JSON (run_code's images).
type RichOutcome = Result<(Value, Vec<ContentBlock>), ToolError>;

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

/// Runs tool `name`; always a result, errors included.
pub async fn call(server: &Session<'_>, name: &str, args: Value, context: &CallContext) -> CallToolResult {
    let outcome: RichOutcome = match name {
        "run_code" => run_code(server, &args, context).await,
        _ => plain_call(server, name, &args, context).await.map(|value| (value, Vec::new())),
    };
    match outcome {
        Ok((value, extra)) => {
            let text = serde_json::to_string_pretty(&value).unwrap_or_default();
            let mut content = vec![ContentBlock::text(text)];
            content.extend(extra);
            let mut result = CallToolResult::success(content);
            result.structured_content = Some(value);
            result
        }
        Err(ToolError(message)) => {
            CallToolResult::error(vec![ContentBlock::text(hide_private_paths(&message, server.moat))])
        }
    }
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

async fn plain_call(server: &Session<'_>, name: &str, args: &Value, context: &CallContext) -> Outcome {
    let args = args.clone();
    match name {
        "create_sandbox" => create_sandbox(server, &args).await,
        "destroy_sandbox" => destroy_sandbox(server, &args).await,
        "list_sandboxes" => Ok(list_sandboxes(server)),
        "run_command" => run_command(server, &args, context).await,
        "read_file" => read_file(server, &args).await,
        "write_file" => write_file(server, &args).await,
        "list_files" => list_files(server, &args).await,
        "make_dir" => make_dir(server, &args).await,
        "move_file" => move_file(server, &args).await,
        "delete_file" => delete_file(server, &args).await,
        "task_start" => task_start(server, &args).await,
        "task_diff" => task_diff(server, &args).await,
        "task_finish" => task_finish(server, &args).await,
        "remove_task" => remove_task(server, &args),
        "copy_to_sandbox" => copy_to_sandbox(server, &args).await,
        "copy_from_sandbox" => copy_from_sandbox(server, &args).await,
        "git_clone" => crate::git::git_clone(server, &args).await,
        "preview_link" => preview_link(server, &args).await,
        other => Err(ToolError(format!("{other} is not available in this build of moat-mcp yet"))),
    }
}

pub(crate) fn str_arg<'a>(args: &'a Value, key: &str) -> Result<Option<&'a str>, ToolError> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ToolError(format!("{key} must be a string"))),
    }
}

pub(crate) fn required<'a>(args: &'a Value, key: &str) -> Result<&'a str, ToolError> {
    str_arg(args, key)?.ok_or_else(|| ToolError(format!("{key} is required")))
}

pub(crate) fn int_arg(args: &Value, key: &str, min: u64, max: u64) -> Result<Option<u64>, ToolError> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(ToolError(format!("{key} must be an integer from {min} to {max}, got {v}"))),
        },
    }
}

fn bool_arg(args: &Value, key: &str) -> Result<bool, ToolError> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ToolError(format!("{key} must be true or false, got {v}"))),
    }
}

/// Paths relative to the user's home are taken as inside it.
fn sandbox_path(path: &str) -> String {
    if path.starts_with('/') { path.to_owned() } else { format!("/home/user/{path}") }
}

pub(crate) fn rfc3339(secs: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)).to_string()
}

/// The sandbox a call acts on: its `sandbox_id`, or the session's current
/// one, created with the defaults when there is none.
pub(crate) async fn target(server: &Session<'_>, args: &Value) -> Result<String, ToolError> {
    if let Some(id) = str_arg(args, "sandbox_id")? {
        owned(server, id)?;
        return Ok(id.to_owned());
    }
    if let Some(id) = server.scope.current()
        && server.moat.get(&id).is_ok()
    {
        return Ok(id);
    }
    let sandbox = server.moat.create(server.defaults.clone()).await?;
    server.scope.adopt(&sandbox.id, true);
    Ok(sandbox.id)
}

/// Checks that sandbox `id` is this session's and still alive.
fn owned(server: &Session<'_>, id: &str) -> Result<(), ToolError> {
    in_scope(server, id)?;
    server.moat.get(id).map(drop).map_err(|e| {
        // A failed sandbox stays listed (and in scope) until destroyed.
        if !matches!(e, CoreError::Failed { .. }) {
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

/// Checks that task `id` was started in this session.
fn own_task(server: &Session<'_>, id: &str) -> Result<(), ToolError> {
    if server.scope.sees_task(id) {
        Ok(())
    } else {
        Err(ToolError(format!("No task {id:?} in this session; list_sandboxes shows this session's tasks")))
    }
}

fn sandbox_json(server: &Session<'_>, sandbox: &moat_core::Sandbox) -> Value {
    let current = server.scope.current().as_deref() == Some(&sandbox.id);
    let mut value = json!({
        "sandbox_id": sandbox.id,
        "name": sandbox.name,
        "state": sandbox.state,
        "backend": sandbox.backend,
        "image": sandbox.image,
        "cpus": sandbox.spec.cpus,
        "memory_mib": sandbox.spec.memory_mib,
        "disk_mib": sandbox.spec.disk_mib,
        "network": sandbox.spec.network,
        "created_at": rfc3339(sandbox.created_at),
        "expires_at": rfc3339(sandbox.expires_at),
        "current": current,
    });
    if let Some(failure) = &sandbox.failure {
        value["failure"] = json!(failure);
    }
    value
}

async fn create_sandbox(server: &Session<'_>, args: &Value) -> Outcome {
    let mut spec = SandboxSpec { name: str_arg(args, "name")?.map(str::to_owned), ..server.defaults.clone() };
    if let Some(image) = str_arg(args, "image")? {
        spec.image = image.to_owned();
    }
    if let Some(cpus) = int_arg(args, "cpus", 1, 16)? {
        spec.cpus = u32::try_from(cpus).unwrap_or(1);
    }
    spec.memory_mib = int_arg(args, "memory_mib", 128, 65_536)?.unwrap_or(spec.memory_mib);
    spec.disk_mib = int_arg(args, "disk_mib", 64, 262_144)?.unwrap_or(spec.disk_mib);
    spec.timeout_seconds = int_arg(args, "timeout_seconds", 60, 28_800)?.unwrap_or(spec.timeout_seconds);
    spec.idle_seconds = int_arg(args, "idle_seconds", 0, 28_800)?.unwrap_or(spec.idle_seconds);
    if let Some(network) = str_arg(args, "network")? {
        spec.network = network.parse::<NetworkPolicy>().map_err(ToolError)?;
    }
    if let Some(hosts) = args.get("allow_hosts").filter(|v| !v.is_null()) {
        let Some(list) = hosts.as_array() else {
            return Err(ToolError("allow_hosts must be an array of host names".into()));
        };
        for host in list {
            let Some(host) = host.as_str() else {
                return Err(ToolError(format!("allow_hosts must hold host names (strings), got {host}")));
            };
            spec.allow_hosts.push(host.trim().to_ascii_lowercase());
        }
        if spec.network != NetworkPolicy::Filtered {
            return Err(ToolError(
                "allow_hosts applies to network 'filtered' only; pass network: \"filtered\" with it".into(),
            ));
        }
    }
    if let Some(env) = args.get("env").filter(|v| !v.is_null()) {
        let Some(map) = env.as_object() else { return Err(ToolError("env must be an object of strings".into())) };
        for (key, value) in map {
            let Some(value) = value.as_str() else { return Err(ToolError(format!("env.{key} must be a string"))) };
            spec.env.push((key.clone(), value.to_owned()));
        }
    }
    let sandbox = server.moat.create(spec).await?;
    server.scope.adopt(&sandbox.id, true);
    Ok(sandbox_json(server, &sandbox))
}

async fn destroy_sandbox(server: &Session<'_>, args: &Value) -> Outcome {
    let id = required(args, "sandbox_id")?;
    // Ownership only: a failed sandbox is destroyed (forgotten) as well.
    in_scope(server, id)?;
    server.moat.destroy(id).await.inspect_err(|_| server.scope.forget(id))?;
    server.scope.forget(id);
    Ok(json!({ "ok": true, "message": format!("sandbox {id} destroyed") }))
}

/// Egress decisions list_sandboxes shows per sandbox (the newest).
const EGRESS_SHOWN: usize = 50;

fn list_sandboxes(server: &Session<'_>) -> Value {
    let sandboxes: Vec<Value> = server
        .moat
        .list()
        .iter()
        .filter(|s| server.scope.owns(&s.id))
        .map(|s| {
            let mut value = sandbox_json(server, s);
            if s.spec.network == NetworkPolicy::Filtered {
                let log = server.moat.egress_log(&s.id).unwrap_or_default();
                let shown: Vec<Value> = log[log.len().saturating_sub(EGRESS_SHOWN)..]
                    .iter()
                    .map(|d| {
                        json!({
                            "at": rfc3339(d.at), "host": d.host, "port": d.port, "allowed": d.allowed,
                            "address": d.address, "reason": d.reason,
                        })
                    })
                    .collect();
                value["egress"] = json!(shown);
                value["allowed_hosts"] = json!(server.moat.allowed_hosts(&s.id).unwrap_or_default());
            }
            value
        })
        .collect();
    let tasks: Vec<Value> = server
        .moat
        .task_records()
        .iter()
        .filter(|r| server.scope.sees_task(&r.task.id))
        .map(|r| {
            json!({
                "task_id": r.task.id,
                "source": r.task.source,
                "finished_at": rfc3339(r.finished_at),
                "patch_path": r.patch_path,
                "summary": r.summary,
            })
        })
        .collect();
    json!({ "sandboxes": sandboxes, "tasks": tasks })
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

/// The most of a command's stderr that [`clip_keeping_report`] keeps as
/// moat's report (one report is a few hundred characters).
const REPORT_KEPT: usize = 4096;

/// A command's stderr clipped as [`clip`] does, except moat's report at its
/// end (which limit the command reached, what held it, what moat did;
/// `moat_agent::cgroup::describe`), which is kept whole after the cut: a
/// fork bomb's thousands of `fork: retry` lines must not hide why it
/// stopped.
fn clip_keeping_report(text: &str) -> (String, bool) {
    let (body, report) = match text.rfind("\nmoat: this command reached") {
        Some(at) if text.len() - at <= REPORT_KEPT => text.split_at(at),
        _ => (text, ""),
    };
    let (mut clipped, cut) = clip(body);
    if cut {
        clipped.push_str(report);
        (clipped, true)
    } else {
        clip(text)
    }
}

async fn run_command(server: &Session<'_>, args: &Value, context: &CallContext) -> Outcome {
    let cmd = required(args, "cmd")?;
    let timeout = int_arg(args, "timeout", 1, 3600)?.unwrap_or(60);
    let cwd = str_arg(args, "cwd")?.map(sandbox_path);
    let stdin = str_arg(args, "stdin")?.map(str::to_owned);
    let background = bool_arg(args, "background")?;
    let id = target(server, args).await?;
    let mut env = Vec::new();
    if let Some(map) = args.get("env").and_then(Value::as_object) {
        for (key, value) in map {
            let Some(value) = value.as_str() else { return Err(ToolError(format!("env.{key} must be a string"))) };
            env.push((key.clone(), value.to_owned()));
        }
    }
    if background {
        let log = format!("/tmp/moat-bg-{}.log", std::process::id() ^ (rand_u32()));
        let script = format!("setsid nohup bash -c {} > {log} 2>&1 < /dev/null & echo $!", shell_quote(cmd));
        let mut req = ExecRequest::shell(script);
        req.cwd = cwd;
        req.env = env;
        let out = server.moat.run(&id, req).await?;
        let pid: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0);
        return Ok(json!({
            "stdout": "", "stderr": "", "exit_code": null, "timed_out": false, "duration_ms": out.status.duration_ms,
            "truncated": false, "pid": pid, "log_path": log,
        }));
    }
    let through_bash = ExecRequest::argv(["bash", "-c", cmd]);
    let mut req = simple_argv(cmd).map_or_else(|| through_bash.clone(), ExecRequest::argv);
    req.cwd = cwd;
    req.env = env;
    req.timeout_ms = Some(timeout * 1000);
    req.stdin = stdin.is_some();
    let started_at = moat_core::sandbox::now();
    let command = moat_core::moat::command_line(&through_bash);
    let mut handle = match server.moat.exec(&id, req.clone()).await {
        Ok(handle) => handle,
        // A direct start that failed (no such program, say): bash gives the
        // answer a shell user knows ("command not found", status 127).
        Err(_) if req.command != through_bash.command => {
            server.moat.exec(&id, ExecRequest { command: through_bash.command, ..req }).await?
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(input) = stdin
        && let Some(mut pipe) = handle.take_stdin()
    {
        tokio::spawn(async move {
            let _ = pipe.write(input.into_bytes().into()).await;
            let _ = pipe.close().await;
        });
    }
    let tail = Tail::default();
    let feed = |_, bytes: &[u8]| tail.feed(bytes);
    let streamed =
        moat_core::moat::stream_output(handle, moat_core::moat::RUN_OUTPUT_LIMIT, context.cancelled.cancelled(), &feed);
    // A sandbox whose agent stops answering (a wedged guest kernel) must
    // not hold the call forever: the agent ends the command at `timeout`.
    let answered = moat_core::moat::answered_within(&id, Some(Duration::from_secs(timeout)), async {
        Ok(with_progress(streamed, context, &tail).await)
    });
    let streamed = match answered.await? {
        Ok(streamed) => streamed,
        Err(source) => return Err(server.moat.agent_error(&id, source).await.into()),
    };
    let Some(out) = streamed else {
        return Err(ToolError("cancelled: the command and everything it started were killed".into()));
    };
    // Streamed, so logged here for a task's execution log.
    server.moat.log_command(&id, &command, started_at, &out);
    let client = server.moat.client(&id)?;
    let stdout_full = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr_full = String::from_utf8_lossy(&out.stderr).into_owned();
    let (stdout, cut_out) = clip(&stdout_full);
    let (stderr, cut_err) = clip_keeping_report(&stderr_full);
    let mut result = json!({
        "stdout": stdout, "stderr": stderr, "exit_code": out.status.code, "timed_out": out.status.timed_out,
        "duration_ms": out.status.duration_ms, "truncated": cut_out || cut_err || out.truncated,
    });
    if cut_out || cut_err {
        // Keep the whole output inside the sandbox for paging with read_file.
        let path = format!("/tmp/moat-output-{}.txt", rand_u32());
        let whole =
            format!("{stdout_full}{}{stderr_full}", if stderr_full.is_empty() { "" } else { "\n--- stderr ---\n" });
        let req = WriteFileRequest {
            path: path.clone(),
            mode: Some(0o644),
            create_parents: true,
            owner: Some("user".into()),
        };
        if client.write_file(req, &mut whole.as_bytes()).await.is_ok() {
            result["full_output_path"] = json!(path);
        }
    }
    Ok(result)
}

/// Bash's builtins and reserved words: a command starting with one must go
/// through bash (`true` and `false` are not here: the programs of those
/// names do exactly what the builtins do).
const BASH_WORDS: &[&str] = &[
    "!",
    "[[",
    "]]",
    "{",
    "}",
    "alias",
    "bg",
    "bind",
    "break",
    "builtin",
    "caller",
    "case",
    "cd",
    "command",
    "compgen",
    "complete",
    "compopt",
    "continue",
    "coproc",
    "declare",
    "dirs",
    "disown",
    "do",
    "done",
    "echo",
    "elif",
    "else",
    "enable",
    "esac",
    "eval",
    "exec",
    "exit",
    "export",
    "fc",
    "fg",
    "fi",
    "for",
    "function",
    "getopts",
    "hash",
    "help",
    "history",
    "if",
    "in",
    "jobs",
    "kill",
    "let",
    "local",
    "logout",
    "mapfile",
    "popd",
    "printf",
    "pushd",
    "pwd",
    "read",
    "readarray",
    "readonly",
    "return",
    "select",
    "set",
    "shift",
    "shopt",
    "source",
    "suspend",
    "test",
    "then",
    "time",
    "times",
    "trap",
    "type",
    "typeset",
    "ulimit",
    "umask",
    "unalias",
    "unset",
    "until",
    "wait",
    "while",
    ".",
    ":",
    "[",
];

/// `cmd` split into words when starting it directly means exactly what
/// bash would do with it: plain words with no quoting, expansion,
/// redirection, operators or assignments, and not a builtin. Skipping
/// bash saves its start-up (about a millisecond) on every such command.
fn simple_argv(cmd: &str) -> Option<Vec<&str>> {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%^".contains(c);
    let words: Vec<&str> = cmd.split([' ', '\t']).filter(|w| !w.is_empty()).collect();
    let first = words.first()?;
    let simple =
        cmd.chars().all(|c| plain(c) || c == ' ' || c == '\t') && !first.contains('=') && !BASH_WORDS.contains(first);
    simple.then_some(words)
}

/// How often a long command reports progress (hosts time out on silence).
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// The latest output of a running command, for progress messages.
#[derive(Default)]
struct Tail(std::sync::Mutex<Vec<u8>>);

impl Tail {
    const KEEP: usize = 4096;

    fn feed(&self, bytes: &[u8]) {
        let mut kept = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        kept.extend_from_slice(&bytes[bytes.len().saturating_sub(Self::KEEP)..]);
        let excess = kept.len().saturating_sub(Self::KEEP);
        kept.drain(..excess);
    }

    /// The last few lines, at most 500 characters.
    fn message(&self) -> String {
        let kept = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let text = String::from_utf8_lossy(&kept);
        let lines: Vec<&str> = text.lines().rev().take(5).collect();
        let tail: String = lines.into_iter().rev().collect::<Vec<_>>().join("\n");
        let start = tail.char_indices().rev().nth(500).map_or(0, |(i, _)| i);
        format!("running… {}", &tail[start..])
    }
}

/// Drives `work` to completion, sending the latest output lines as a
/// progress notification every [`PROGRESS_EVERY`] when the client asked for
/// progress.
async fn with_progress<F: Future>(work: F, context: &CallContext, tail: &Tail) -> F::Output {
    tokio::pin!(work);
    let Some(token) = &context.progress else { return work.await };
    let mut tick = tokio::time::interval(PROGRESS_EVERY);
    tick.tick().await;
    let mut reports = 0u32;
    loop {
        tokio::select! {
            done = &mut work => return done,
            _ = tick.tick() => {
                reports += 1;
                let param =
                    ProgressNotificationParam::new(token.clone(), f64::from(reports)).with_message(tail.message());
                let _ = context.peer.notify_progress(param).await;
            }
        }
    }
}

async fn run_code(server: &Session<'_>, args: &Value, context: &CallContext) -> RichOutcome {
    let code = required(args, "code")?;
    let language = match str_arg(args, "language")? {
        None => Language::Python,
        Some(name) => name.parse::<Language>().map_err(ToolError)?,
    };
    let timeout = std::time::Duration::from_secs(int_arg(args, "timeout", 1, 3600)?.unwrap_or(300));
    let id = target(server, args).await?;
    let tail = Tail::default();
    let feed = |_, bytes: &[u8]| tail.feed(bytes);
    let run = server.moat.run_code(&id, language, code, timeout, context.cancelled.cancelled(), &feed);
    let output = with_progress(run, context, &tail).await?;
    let (stdout, cut_out) = clip(&String::from_utf8_lossy(&output.stdout));
    let (stderr, cut_err) = clip(&String::from_utf8_lossy(&output.stderr));
    let (text, cut_text) = clip(&output.text);
    let mut extra = Vec::new();
    let mut results = Vec::new();
    for (index, bundle) in output.results.iter().enumerate() {
        results.push(json!({ "index": index, "mime_types": bundle.keys().collect::<Vec<_>>() }));
        for (mime, value) in bundle {
            let Some(data) = value.as_str() else { continue };
            match mime.as_str() {
                "image/png" | "image/jpeg" => extra.push(ContentBlock::image(data, mime)),
                "image/svg+xml" => extra.push(ContentBlock::resource(
                    ResourceContents::text(data, format!("moat://sandbox/{id}/results/{index}.svg"))
                        .with_mime_type(mime),
                )),
                _ => {}
            }
        }
    }
    let mut value = json!({
        "text": text, "stdout": stdout, "stderr": stderr, "error": output.error, "results": results,
        "truncated": output.truncated || cut_out || cut_err || cut_text,
    });
    if let Some(count) = output.execution_count {
        value["execution_count"] = json!(count);
    }
    Ok((value, extra))
}

async fn preview_link(server: &Session<'_>, args: &Value) -> Outcome {
    let port = int_arg(args, "port", 1, 65_535)?.ok_or_else(|| ToolError("port is required".into()))?;
    let id = target(server, args).await?;
    let link = server.moat.preview_link(&id, u16::try_from(port).unwrap_or(1)).await?;
    Ok(json!({ "url": link.url, "port": link.port, "token": link.token, "expires_at": rfc3339(link.expires_at) }))
}

fn rand_u32() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
}

pub(crate) fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

async fn read_file(server: &Session<'_>, args: &Value) -> Outcome {
    let path = sandbox_path(required(args, "path")?);
    let base64 = match str_arg(args, "encoding")? {
        None | Some("utf8") => false,
        Some("base64") => true,
        Some(other) => return Err(ToolError(format!("encoding {other:?} is not known; use utf8 or base64"))),
    };
    let offset = int_arg(args, "offset", 0, u64::MAX >> 1)?.unwrap_or(0);
    let length = int_arg(args, "length", 1, 10 << 20)?;
    let id = target(server, args).await?;
    let length = length.unwrap_or(10 << 20);
    let read = |client: moat_proto::AgentClient<moat_proto::UnixConnector>| {
        let path = path.clone();
        async move {
            let info = client.stat(path.clone()).await?;
            let bytes = client.read_file(ReadFileRequest { path, offset, length: Some(length) }).await?;
            Ok((info, bytes))
        }
    };
    let (info, bytes) = server.moat.with_agent(&id, read).await?;
    let truncated = offset + (bytes.len() as u64) < info.size;
    let content = if base64 {
        base64::engine::general_purpose::STANDARD.encode(&bytes)
    } else {
        match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(_) => return Err(ToolError(format!("{path} is not UTF-8 text; read it with encoding base64"))),
        }
    };
    Ok(json!({
        "path": path, "content": content, "encoding": if base64 { "base64" } else { "utf8" },
        "size": info.size, "offset": offset, "length": length, "truncated": truncated,
    }))
}

async fn write_file(server: &Session<'_>, args: &Value) -> Outcome {
    let path = sandbox_path(required(args, "path")?);
    let content = required(args, "content")?;
    let bytes = match str_arg(args, "encoding")? {
        None | Some("utf8") => content.as_bytes().to_vec(),
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(content)
            .map_err(|e| ToolError(format!("content is not valid base64 ({e}); send the bytes base64-encoded")))?,
        Some(other) => return Err(ToolError(format!("encoding {other:?} is not known; use utf8 or base64"))),
    };
    let mode = match str_arg(args, "mode")? {
        None => None,
        Some(m) => Some(
            u32::from_str_radix(m.trim_start_matches("0o"), 8)
                .map_err(|_| ToolError(format!("mode {m:?} is not an octal permission such as 644 or 755")))?,
        ),
    };
    let id = target(server, args).await?;
    let req = WriteFileRequest { path: path.clone(), mode, create_parents: true, owner: Some("user".into()) };
    let written = server
        .moat
        .with_agent(&id, |client| async move { client.write_file(req, &mut bytes.as_slice()).await })
        .await?;
    Ok(json!({ "path": path, "bytes": written }))
}

async fn list_files(server: &Session<'_>, args: &Value) -> Outcome {
    let path = sandbox_path(str_arg(args, "path")?.unwrap_or("/home/user"));
    let depth = int_arg(args, "depth", 1, 5)?.unwrap_or(1);
    let id = target(server, args).await?;
    let depth = u8::try_from(depth).unwrap_or(1);
    let (entries, truncated) =
        server.moat.with_agent(&id, |client| async move { client.list_dir(path, depth).await }).await?;
    let entries: Vec<Value> = entries
        .iter()
        .map(|e| {
            json!({
                "name": e.name, "path": e.path,
                "type": match e.kind { FileKind::File => "file", FileKind::Dir => "dir", FileKind::Symlink => "symlink", FileKind::Other => "other" },
                "size": e.size, "mode": format!("{:o}", e.mode),
                "mtime": rfc3339(u64::try_from(e.mtime).unwrap_or(0)),
            })
        })
        .collect();
    Ok(json!({ "entries": entries, "truncated": truncated }))
}

async fn make_dir(server: &Session<'_>, args: &Value) -> Outcome {
    let path = sandbox_path(required(args, "path")?);
    let id = target(server, args).await?;
    let made = path.clone();
    server.moat.with_agent(&id, |client| async move { client.make_dir(made, Some("user".into())).await }).await?;
    Ok(json!({ "ok": true, "message": format!("{path} exists") }))
}

async fn move_file(server: &Session<'_>, args: &Value) -> Outcome {
    let from = sandbox_path(required(args, "source")?);
    let to = sandbox_path(required(args, "destination")?);
    let overwrite = bool_arg(args, "overwrite")?;
    let id = target(server, args).await?;
    let (source, destination) = (from.clone(), to.clone());
    server.moat.with_agent(&id, |client| async move { client.move_path(source, destination, overwrite).await }).await?;
    Ok(json!({ "ok": true, "message": format!("moved {from} to {to}") }))
}

async fn delete_file(server: &Session<'_>, args: &Value) -> Outcome {
    let path = sandbox_path(required(args, "path")?);
    let recursive = bool_arg(args, "recursive")?;
    let id = target(server, args).await?;
    let removed = path.clone();
    server.moat.with_agent(&id, |client| async move { client.remove(removed, recursive).await }).await?;
    Ok(json!({ "ok": true, "message": format!("deleted {path}") }))
}

async fn task_start(server: &Session<'_>, args: &Value) -> Outcome {
    let source = required(args, "source")?;
    let spec = SandboxSpec { name: str_arg(args, "name")?.map(str::to_owned), ..server.defaults.clone() };
    let task = server.moat.task_start(std::path::Path::new(source), spec).await?;
    server.scope.adopt(&task.sandbox_id, true);
    server.scope.adopt_task(&task.id);
    Ok(json!({
        "task_id": task.id, "sandbox_id": task.sandbox_id, "runtime": task.runtime, "files": task.files,
        "workspace": "/workspace",
    }))
}

async fn task_diff(server: &Session<'_>, args: &Value) -> Outcome {
    let task_id = required(args, "task_id")?;
    own_task(server, task_id)?;
    let (diff, summary) = server.moat.task_diff(task_id).await?;
    let (diff, truncated) = clip(&diff);
    Ok(json!({ "diff": diff, "summary": summary, "truncated": truncated }))
}

async fn task_finish(server: &Session<'_>, args: &Value) -> Outcome {
    let task_id = required(args, "task_id")?;
    own_task(server, task_id)?;
    let record = server.moat.task_finish(task_id, bool_arg(args, "keep_sandbox")?).await?;
    if !record.sandbox_kept {
        server.scope.forget(&record.task.sandbox_id);
    }
    Ok(json!({
        "task_id": record.task.id, "patch_path": record.patch_path, "log_path": record.log_path,
        "summary": record.summary, "sandbox_kept": record.sandbox_kept,
    }))
}

async fn copy_to_sandbox(server: &Session<'_>, args: &Value) -> Outcome {
    let host = std::path::PathBuf::from(required(args, "host_path")?);
    let dest = sandbox_path(required(args, "sandbox_path")?);
    let id = target(server, args).await?;
    let copied = server.moat.copy_to_sandbox(&id, &host, &dest).await?;
    Ok(json!({ "files": copied.files, "bytes": copied.bytes, "skipped": copied.skipped }))
}

async fn copy_from_sandbox(server: &Session<'_>, args: &Value) -> Outcome {
    let source = sandbox_path(required(args, "sandbox_path")?);
    let host = std::path::PathBuf::from(required(args, "host_path")?);
    let id = target(server, args).await?;
    let copied = server.moat.copy_from_sandbox(&id, &source, &host).await?;
    Ok(json!({ "files": copied.files, "bytes": copied.bytes, "skipped": copied.skipped }))
}

fn remove_task(server: &Session<'_>, args: &Value) -> Outcome {
    let id = required(args, "task_id")?;
    own_task(server, id)?;
    server.moat.remove_task(id)?;
    server.scope.forget_task(id);
    Ok(json!({ "ok": true, "message": format!("task record {id} removed") }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_report_survives_the_cut_of_a_long_stderr() {
        let report = "\nmoat: this command reached the sandbox's process limit (960 processes): forks failed.\n";
        let flood = "bash: fork: retry: Resource temporarily unavailable\n".repeat(5000);
        let (kept, cut) = clip_keeping_report(&format!("{flood}{report}"));
        assert!(cut && kept.contains("[truncated: ") && kept.ends_with(report), "{}", &kept[kept.len() - 300..]);
        assert!(kept.chars().count() < MAX_TEXT + REPORT_KEPT);
        let short = format!("a few lines{report}");
        assert_eq!(clip_keeping_report(&short), (short.clone(), false), "short output is not touched");
        let (plain, cut) = clip_keeping_report(&flood);
        assert_eq!((plain, cut), clip(&flood), "without a report, a plain cut");
    }

    #[test]
    fn only_plain_commands_skip_bash() {
        assert_eq!(simple_argv("ls -la /tmp"), Some(vec!["ls", "-la", "/tmp"]));
        assert_eq!(simple_argv("true"), Some(vec!["true"]));
        assert_eq!(simple_argv("python3 -m pip --version"), Some(vec!["python3", "-m", "pip", "--version"]));
        for shell in [
            "echo hi",
            "cd /tmp",
            "ls *.py",
            "ls ~",
            "a=1 env",
            "ls > x",
            "ls; ls",
            "ls | wc",
            "ls && ls",
            "echo $HOME",
            "ls 'a b'",
            "ls {a,b}",
            "ls\nls",
            "ls # note",
            "ls &",
            "(ls)",
            "",
            "   ",
        ] {
            assert_eq!(simple_argv(shell), None, "{shell:?} needs bash");
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

    #[test]
    fn the_contract_parses_into_tools() {
        let tools = crate::contract_tools().expect("tools.json is valid");
        assert_eq!(tools.len(), 19);
        assert!(tools.iter().all(|t| t.description.is_some() && t.annotations.is_some()));
    }
}
