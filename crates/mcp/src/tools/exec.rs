//! `run_command` and `run_code`: a command or a code cell run in the
//! sandbox, its output streamed as progress and returned clipped.
//!
//! [`execute`] is the whole of `run_command`'s exchange with core: one
//! call of `Moat::exec_streaming` (start, stdin, streaming, the answer
//! deadline, the task log); the rest reads arguments and shapes the result.

use std::collections::BTreeMap;
use std::time::Duration;

use moat_core::limits::{MAX_ARGUMENT_ENTRIES, MAX_COMMAND_SECONDS};
use moat_core::{ExecOutcome, Language, StreamedCommand};
use moat_proto::{ExecRequest, WriteFileRequest};
use rmcp::model::{ContentBlock, ProgressNotificationParam, ResourceContents};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use super::{
    CallContext, Outcome, RichOutcome, SandboxRef, Session, Tool, ToolError, clip, plain, rand_u32, sandbox_path,
};

/// A command's seconds when `timeout` is not given.
const COMMAND_TIMEOUT: u64 = 60;

/// A code cell's seconds when `timeout` is not given.
const CODE_TIMEOUT: u64 = 300;

/// The arguments of `run_command`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct RunCommand {
    cmd: String,
    cwd: Option<String>,
    #[schemars(extend("maxProperties" = MAX_ARGUMENT_ENTRIES))]
    env: Option<BTreeMap<String, String>>,
    stdin: Option<String>,
    #[schemars(range(min = 1, max = MAX_COMMAND_SECONDS))]
    timeout: Option<u64>,
    background: Option<bool>,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for RunCommand {
    const NAME: &'static str = "run_command";

    async fn run(self, server: &Session<'_>, context: &CallContext) -> RichOutcome {
        plain(run_command(server, self, context).await)
    }
}

/// The languages by the names the contract gives them (the schema of
/// [`Language`], which core states without `schemars`).
#[derive(JsonSchema)]
#[serde(rename_all = "lowercase")]
#[schemars(inline)]
#[expect(dead_code, reason = "a schema only: arguments are read as Language")]
enum LanguageName {
    Python,
    Bash,
    Node,
}

/// The arguments of `run_code`.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(extend("additionalProperties" = false))]
pub(crate) struct RunCode {
    code: String,
    #[schemars(with = "Option<LanguageName>")]
    language: Option<Language>,
    #[schemars(range(min = 1, max = MAX_COMMAND_SECONDS))]
    timeout: Option<u64>,
    #[serde(flatten)]
    sandbox: SandboxRef,
}

impl Tool for RunCode {
    const NAME: &'static str = "run_code";

    async fn run(self, server: &Session<'_>, context: &CallContext) -> RichOutcome {
        run_code(server, self, context).await
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

/// The longest the start of a background command may take.
const BACKGROUND_START: Duration = Duration::from_secs(30);

async fn run_command(server: &Session<'_>, args: RunCommand, context: &CallContext) -> Outcome {
    let RunCommand { cmd, cwd, env, stdin, timeout, background, sandbox } = args;
    let timeout = timeout.unwrap_or(COMMAND_TIMEOUT);
    let cwd = cwd.as_deref().map(sandbox_path);
    let id = sandbox.resolve(server).await?;
    let env: Vec<(String, String)> = env.into_iter().flatten().collect();
    if background.unwrap_or(false) {
        let log = format!("/tmp/moat-bg-{}.log", std::process::id() ^ (rand_u32()));
        let quoted = shlex::try_quote(&cmd).map_err(|_| ToolError("cmd must not hold NUL characters".into()))?;
        let script = format!("setsid nohup bash -c {quoted} > {log} 2>&1 < /dev/null & echo $!");
        let mut req = ExecRequest::shell(script);
        req.cwd = cwd;
        req.env = env;
        // Starting it takes a moment; what the sandbox's shell or `env`
        // makes of it (a profile that waits, LD_PRELOAD) is bounded.
        req.timeout_ms = Some(BACKGROUND_START.as_secs() * 1000);
        req.output_limit = Some(4096);
        let out = server.moat.run(&id, req).await?;
        if out.status.timed_out {
            return Err(ToolError(format!(
                "starting the background command did not finish within {} s (the sandbox's shell or the env \
                 given may hold it); check with a foreground run_command",
                BACKGROUND_START.as_secs()
            )));
        }
        let pid: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0);
        return Ok(json!({
            "stdout": "", "stderr": "", "exit_code": null, "timed_out": false, "duration_ms": out.status.duration_ms,
            "truncated": false, "pid": pid, "log_path": log,
        }));
    }
    let out = execute(server, &id, Command { cmd: &cmd, cwd, env, stdin, timeout }, context).await?;
    let client = server.moat.client(&id).await?;
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
        // Bounded as every wait on an agent is: one that takes the
        // output and never answers leaves the call without the path.
        let saved = moat_core::timing::within(&id, SAVE_GUARD, client.write_file(req, &mut whole.as_bytes())).await;
        if matches!(saved, Ok(Ok(_))) {
            result["full_output_path"] = json!(path);
        }
    }
    Ok(result)
}

/// How long saving a clipped command's whole output in its sandbox may
/// take (at most the command's output limit, over a local socket).
const SAVE_GUARD: std::time::Duration = moat_core::timing::ANSWER_GRACE;

/// A foreground command as [`execute`] runs it.
struct Command<'a> {
    cmd: &'a str,
    cwd: Option<String>,
    env: Vec<(String, String)>,
    stdin: Option<String>,
    /// Seconds.
    timeout: u64,
}

/// Runs `command` in sandbox `id` with `Moat::exec_streaming` and returns
/// its output: started directly when that means what bash would do, else by
/// `bash -c`; stdin fed and output streamed as progress. Core bounds the
/// call past the command's timeout even when the agent stops answering, and
/// logs the command for a task's execution log.
async fn execute(
    server: &Session<'_>,
    id: &str,
    command: Command<'_>,
    context: &CallContext,
) -> Result<moat_proto::Output, ToolError> {
    let Command { cmd, cwd, env, stdin, timeout } = command;
    let mut request = ExecRequest::argv(["bash", "-c", cmd]);
    request.cwd = cwd;
    request.env = env;
    request.timeout_ms = Some(timeout * 1000);
    let direct = simple_argv(cmd).map(|argv| argv.into_iter().map(str::to_owned).collect());
    let command = StreamedCommand { request, direct, stdin: stdin.map(String::into_bytes) };
    let tail = Tail::default();
    let feed = |_, bytes: &[u8]| tail.feed(bytes);
    // Logged for a task's execution log, and given up when the agent stops
    // answering past `timeout` (a wedged guest kernel), by core.
    let run = server.moat.exec_streaming(id, command, &feed, context.cancelled.cancelled());
    let ExecOutcome::Finished(out) = with_progress(run, context, &tail).await? else {
        return Err(ToolError("cancelled: the command and everything it started were killed".into()));
    };
    Ok(out)
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

async fn run_code(server: &Session<'_>, args: RunCode, context: &CallContext) -> RichOutcome {
    let RunCode { code, language, timeout, sandbox } = args;
    let language = language.unwrap_or(Language::Python);
    let timeout = Duration::from_secs(timeout.unwrap_or(CODE_TIMEOUT));
    let id = sandbox.resolve(server).await?;
    let code = code.as_str();
    let tail = Tail::default();
    let feed = |_, bytes: &[u8]| tail.feed(bytes);
    let run = server.moat.run_code(&id, language, code, timeout, context.cancelled.cancelled(), &feed);
    let output = with_progress(run, context, &tail).await?;
    let (stdout, cut_out) = clip(&String::from_utf8_lossy(&output.stdout));
    let (stderr, cut_err) = clip(&String::from_utf8_lossy(&output.stderr));
    let (text, cut_text) = clip(&output.text);
    // The error is the cell's (its code chose the message): cut like the
    // streams.
    let mut cut_error = false;
    let error = output.error.as_ref().map(|e| {
        let (value, a) = clip(&e.value);
        let (traceback, b) = clip(&e.traceback);
        cut_error = a || b;
        json!({ "name": e.name, "value": value, "traceback": traceback })
    });
    let mut extra = Vec::new();
    let mut results = Vec::new();
    for (index, bundle) in output.results.iter().enumerate() {
        let mut entry = json!({ "index": index, "mime_types": bundle.keys().collect::<Vec<_>>() });
        for (mime, value) in bundle {
            let Some(data) = value.as_str() else { continue };
            match mime.as_str() {
                "image/png" | "image/jpeg" => {
                    // Base64 as some libraries write it, in lines.
                    let data: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
                    if is_image(&data, mime) {
                        extra.push(ContentBlock::image(data, mime));
                    } else {
                        entry["left_out"] = json!(format!("its {mime} is not base64 of a {mime} image"));
                    }
                }
                "image/svg+xml" => extra.push(ContentBlock::resource(
                    ResourceContents::text(data, format!("moat://sandbox/{id}/results/{index}.svg"))
                        .with_mime_type(mime),
                )),
                _ => {}
            }
        }
        results.push(entry);
    }
    let mut value = json!({
        "text": text, "stdout": stdout, "stderr": stderr, "error": error, "results": results,
        "truncated": output.truncated || cut_out || cut_err || cut_text || cut_error,
    });
    if let Some(count) = output.execution_count {
        value["execution_count"] = json!(count);
    }
    Ok((value, extra))
}

/// Whether `data` is what an MCP image block must carry: standard base64
/// (whole groups of four, `=` only as padding) of an image whose first
/// bytes are `mime`'s (a PNG's signature, a JPEG's start of image). A
/// cell's results are the sandbox's words: a client given anything else as
/// an image may refuse the whole result, or hand it to its image decoder.
fn is_image(data: &str, mime: &str) -> bool {
    let bytes = data.as_bytes();
    let body = bytes.strip_suffix(b"==").or_else(|| bytes.strip_suffix(b"=")).unwrap_or(bytes);
    let alphabet = |b: &u8| b.is_ascii_alphanumeric() || *b == b'+' || *b == b'/';
    let signature = match mime {
        // \x89PNG\r\n\x1a\n and \xff\xd8\xff, as base64.
        "image/png" => "iVBORw0KGgo",
        "image/jpeg" => "/9j/",
        _ => return false,
    };
    bytes.len().is_multiple_of(4) && body.iter().all(alphabet) && data.starts_with(signature)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::MAX_TEXT;

    #[test]
    fn only_base64_of_an_image_of_its_type_is_an_image() {
        let png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
        assert!(is_image(png, "image/png"));
        assert!(is_image("/9j/4AAQ", "image/jpeg"));
        assert!(!is_image(png, "image/jpeg"), "a PNG called a JPEG");
        for bad in ["", "iVBORw0KGgo", "iVBORw0KGgo\"}]", "iVBORw0KGgo=AAA", "iVBORw0KGgoA AAA", "PHN2ZyA+PC9zdmc+"] {
            assert!(!is_image(bad, "image/png"), "{bad:?}");
        }
    }

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
    fn a_background_command_reaches_bash_as_one_word() {
        for cmd in ["python3 -m http.server 8000", "echo 'it''s' \"$HOME\" && sleep 1 &", "a\nb\\c;`x`"] {
            let quoted = shlex::try_quote(cmd).expect("no NUL");
            assert_eq!(shlex::split(&quoted), Some(vec![cmd.to_owned()]), "{quoted}");
        }
        assert!(shlex::try_quote("a\0b").is_err(), "NUL cannot reach bash");
    }
}
