//! `run_code`: code run like a notebook cell. Python runs in an IPython
//! `InteractiveShell` that lives as long as its sandbox (started on first
//! use), so variables and imports persist between calls; bash and node run
//! each snippet as a process.
//!
//! The Python side is `runner.py`, started with `python3 -c` through the
//! agent and driven over its stdin/stdout with JSON lines (the protocol is
//! described at the top of that file). Rich results (matplotlib figures,
//! pandas tables, SVG) come back as MIME bundles.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use moat_proto::{ExecHandle, ExecRequest, ExecStdin, Output};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::sync::mpsc;

/// The program the Python session runs.
const RUNNER: &str = include_str!("runner.py");

/// How long an interrupted cell gets to stop before its session is
/// restarted.
const INTERRUPT_GRACE: Duration = Duration::from_secs(5);

/// The largest protocol line accepted from the runner (a cell's results,
/// images included).
const MAX_EVENT: usize = 256 << 20;

/// How much of the runner's own diagnostics is kept for error reports.
const DIAG_KEEP: usize = 8 << 10;

/// A language `run_code` speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    #[default]
    Python,
    Bash,
    Node,
}

impl std::str::FromStr for Language {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "python" => Ok(Self::Python),
            "bash" => Ok(Self::Bash),
            "node" => Ok(Self::Node),
            other => Err(format!("language {other:?} is not supported; use python, bash or node")),
        }
    }
}

/// Which output stream a piece of text came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamName {
    Stdout,
    Stderr,
}

/// An exception or failure of the code, reported as data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodeError {
    pub name: String,
    pub value: String,
    pub traceback: String,
}

/// What a `run_code` call produced.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CodeOutput {
    /// The plain-text value of the cell's last expression (Python), if any.
    pub text: String,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub error: Option<CodeError>,
    /// Python's cell number; `None` for bash and node.
    pub execution_count: Option<u64>,
    /// Rich results in order: displays (figures shown) then the cell's
    /// value when it has more than plain text. Each maps MIME type to
    /// content (base64 for binary types).
    pub results: Vec<Map<String, Value>>,
    /// Output beyond the run limit was dropped.
    pub truncated: bool,
}

/// Why a cell did not finish on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Timeout(Duration),
    Cancelled,
}

impl Stop {
    fn error(self, restarted: bool, traceback: String) -> CodeError {
        let what = match self {
            Self::Timeout(limit) => format!("the code ran longer than its timeout of {} s", limit.as_secs()),
            Self::Cancelled => "the request was cancelled".to_owned(),
        };
        let value = if restarted {
            format!("{what} and did not stop when interrupted, so the Python session was stopped")
        } else {
            format!("{what} and was interrupted; variables defined so far are kept")
        };
        let name = match self {
            Self::Timeout(_) => "TimeoutError",
            Self::Cancelled => "Cancelled",
        };
        CodeError { name: name.to_owned(), value, traceback }
    }
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum Event {
    Ready,
    Stream {
        name: String,
        text: String,
        /// Characters the runner read past the cell's limit and dropped.
        #[serde(default)]
        dropped: u64,
    },
    Done {
        execution_count: u64,
        result: Option<Map<String, Value>>,
        displays: Vec<Map<String, Value>>,
        error: Option<CodeError>,
    },
}

/// Why the session cannot go on; the caller drops it.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("The Python session could not start: {0}")]
    Start(String),
    #[error("The Python session ended{0}")]
    Ended(String),
    #[error("The Python session sent a bad message ({0})")]
    Protocol(String),
    #[error("{}", .0.value)]
    Interrupted(CodeError),
}

/// A running Python session of one sandbox.
pub(crate) struct PythonSession {
    handle: ExecHandle,
    stdin: ExecStdin,
    stdout: mpsc::Receiver<Bytes>,
    pending: Vec<u8>,
    diagnostics: Arc<Mutex<Vec<u8>>>,
}

impl std::fmt::Debug for PythonSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PythonSession").field("pid", &self.handle.pid()).finish_non_exhaustive()
    }
}

impl PythonSession {
    /// The request that starts a session.
    pub(crate) fn request() -> ExecRequest {
        let mut request = ExecRequest::argv(["python3", "-c", RUNNER]);
        request.stdin = true;
        request.env.push(("PYTHONUNBUFFERED".into(), "1".into()));
        request
    }

    /// Takes over a started runner and waits until it is ready, at most
    /// `within`: a runner not ready by then is stopped (dropping its
    /// connection makes the agent kill it).
    pub(crate) async fn start(mut handle: ExecHandle, within: Duration) -> Result<Self, SessionError> {
        let stdin = handle.take_stdin().ok_or_else(|| SessionError::Start("no stdin".into()))?;
        let stdout = handle.take_stdout().ok_or_else(|| SessionError::Start("no stdout".into()))?;
        let diagnostics = Arc::new(Mutex::new(Vec::new()));
        if let Some(mut stderr) = handle.take_stderr() {
            // Drained always: a full stderr channel would stall stdout too.
            let keep = diagnostics.clone();
            tokio::spawn(async move {
                while let Some(chunk) = stderr.recv().await {
                    let mut kept = keep.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    kept.extend_from_slice(&chunk);
                    let excess = kept.len().saturating_sub(DIAG_KEEP);
                    kept.drain(..excess);
                }
            });
        }
        let mut session = Self { handle, stdin, stdout, pending: Vec::new(), diagnostics };
        match tokio::time::timeout(within, session.next_event()).await {
            Ok(Ok(Event::Ready)) => Ok(session),
            Ok(Ok(other)) => Err(SessionError::Protocol(format!("expected ready, got {other:?}"))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SessionError::Start(format!(
                "python3 was not ready within {} s{}; the sandbox is overloaded or stuck. Run the code \
                     again, or destroy the sandbox and create another if it does not answer",
                within.as_secs(),
                session.said()
            ))),
        }
    }

    /// Runs one cell. Text streams reach `on_stream` as they come;
    /// `limit` bounds what is kept of each stream. Returns the output and
    /// whether the session can run another cell (when not, the output's
    /// error says why and the caller drops the session).
    pub(crate) async fn execute(
        &mut self,
        code: &str,
        timeout: Duration,
        cancelled: impl Future<Output = ()>,
        limit: usize,
        on_stream: &(dyn Fn(StreamName, &[u8]) + Sync),
    ) -> (CodeOutput, bool) {
        let mut output = CodeOutput::default();
        match self.run_cell(code, timeout, cancelled, limit, on_stream, &mut output).await {
            Ok(()) => (output, true),
            Err(error) => {
                let name = match &error {
                    SessionError::Interrupted(stopped) => stopped.name.clone(),
                    _ => "SessionEnded".to_owned(),
                };
                let restart = "; the next run_code starts a fresh Python session (variables and imports are lost)";
                let value = format!("{error}{restart}");
                output.error = Some(CodeError { name, value, traceback: String::new() });
                (output, false)
            }
        }
    }

    async fn run_cell(
        &mut self,
        code: &str,
        timeout: Duration,
        cancelled: impl Future<Output = ()>,
        limit: usize,
        on_stream: &(dyn Fn(StreamName, &[u8]) + Sync),
        output: &mut CodeOutput,
    ) -> Result<(), SessionError> {
        // The runner stops sending a stream past `limit` characters (at most
        // `limit` bytes here are kept of it anyway).
        let line = serde_json::json!({ "code": code, "limit": limit }).to_string() + "\n";
        self.stdin.write(Bytes::from(line)).await.map_err(|_| self.ended())?;
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        tokio::pin!(cancelled);
        let mut stop: Option<Stop> = None;
        loop {
            let event = match stop {
                Some(stop) => match tokio::time::timeout(INTERRUPT_GRACE, self.next_event()).await {
                    Ok(event) => event?,
                    Err(_) => return Err(SessionError::Interrupted(stop.error(true, String::new()))),
                },
                None => tokio::select! {
                    event = self.next_event() => event?,
                    () = &mut deadline => { stop = Some(Stop::Timeout(timeout)); self.interrupt().await; continue }
                    () = &mut cancelled => { stop = Some(Stop::Cancelled); self.interrupt().await; continue }
                },
            };
            match event {
                Event::Ready => return Err(SessionError::Protocol("ready in the middle of a cell".into())),
                Event::Stream { name, text, dropped } => {
                    output.truncated |= dropped > 0;
                    let (stream, buffer) = if name == "stderr" {
                        (StreamName::Stderr, &mut output.stderr)
                    } else {
                        (StreamName::Stdout, &mut output.stdout)
                    };
                    on_stream(stream, text.as_bytes());
                    let room = limit.saturating_sub(buffer.len());
                    output.truncated |= text.len() > room;
                    buffer.extend_from_slice(&text.as_bytes()[..text.len().min(room)]);
                }
                Event::Done { execution_count, result, displays, error } => {
                    output.execution_count = Some(execution_count);
                    output.results = displays;
                    if let Some(mut result) = result {
                        if let Some(Value::String(text)) = result.remove("text/plain") {
                            output.text = text;
                        }
                        if !result.is_empty() {
                            output.results.push(result);
                        }
                    }
                    output.error = match stop {
                        Some(stop) => Some(stop.error(false, error.map(|e| e.traceback).unwrap_or_default())),
                        None => error,
                    };
                    return Ok(());
                }
            }
        }
    }

    /// SIGINT to the cell's process group: a KeyboardInterrupt in Python.
    async fn interrupt(&self) {
        let _ = self.handle.signal(libc_sigint()).await;
    }

    fn ended(&self) -> SessionError {
        SessionError::Ended(self.said())
    }

    /// What the runner wrote to stderr lately, as " (…)", or nothing.
    fn said(&self) -> String {
        let diagnostics = self.diagnostics.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let text = String::from_utf8_lossy(&diagnostics);
        let text = text.trim();
        if text.is_empty() { String::new() } else { format!(" ({text})") }
    }

    async fn next_event(&mut self) -> Result<Event, SessionError> {
        loop {
            if let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                return serde_json::from_slice(&line).map_err(|e| SessionError::Protocol(e.to_string()));
            }
            if self.pending.len() > MAX_EVENT {
                return Err(SessionError::Protocol(format!("a message longer than {} MiB", MAX_EVENT >> 20)));
            }
            match self.stdout.recv().await {
                Some(chunk) => self.pending.extend_from_slice(&chunk),
                None => {
                    // Give the stderr drain a moment to catch the last words.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return Err(self.ended());
                }
            }
        }
    }
}

fn libc_sigint() -> i32 {
    nix::sys::signal::Signal::SIGINT as i32
}

impl CodeOutput {
    /// The result of a bash or node snippet run as one process (`None`:
    /// cancelled and killed). A non-zero exit is the snippet's error, named
    /// after the last `SomeError: message` line of stderr when there is one.
    pub(crate) fn from_process(process: Option<Output>, timeout: Duration) -> Self {
        let Some(process) = process else {
            let error = CodeError {
                name: "Cancelled".into(),
                value: "the request was cancelled; the process and everything it started were killed".into(),
                traceback: String::new(),
            };
            return Self { error: Some(error), ..Self::default() };
        };
        let stderr_text = String::from_utf8_lossy(&process.stderr).into_owned();
        let status = &process.status;
        let error = if status.timed_out {
            Some(CodeError {
                name: "TimeoutError".into(),
                value: format!(
                    "the code ran longer than its timeout of {} s and was killed with everything it started",
                    timeout.as_secs()
                ),
                traceback: tail_lines(&stderr_text, 30),
            })
        } else if status.code != Some(0) {
            let how = match (status.code, status.signal) {
                (Some(code), _) => format!("exited with status {code}"),
                (None, Some(signal)) => format!("was killed by signal {signal}"),
                (None, None) => "ended abnormally".to_owned(),
            };
            let (name, value) = last_exception(&stderr_text).unwrap_or(("NonZeroExit".to_owned(), how));
            Some(CodeError { name, value, traceback: tail_lines(&stderr_text, 30) })
        } else {
            None
        };
        Self {
            text: String::new(),
            stdout: process.stdout,
            stderr: process.stderr,
            error,
            execution_count: None,
            results: Vec::new(),
            truncated: process.truncated,
        }
    }
}

/// The last `Name: message` line of an error report where `Name` ends in
/// `Error` or `Exception` (as node prints an uncaught exception).
fn last_exception(stderr: &str) -> Option<(String, String)> {
    stderr.lines().rev().find_map(|line| {
        let (name, value) = line.trim().split_once(": ")?;
        let plain = name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        (plain && (name.ends_with("Error") || name.ends_with("Exception"))).then(|| (name.to_owned(), value.to_owned()))
    })
}

fn tail_lines(text: &str, count: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(count)..].join("\n")
}

/// The process that runs a bash or node snippet.
pub(crate) fn snippet_request(language: Language, code: &str) -> ExecRequest {
    match language {
        Language::Bash => ExecRequest::argv(["bash", "-c", code]),
        Language::Node => ExecRequest::argv(["node", "-e", code]),
        Language::Python => ExecRequest::argv(["python3", "-c", code]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn languages_parse_and_say_what_is_allowed() {
        assert_eq!("node".parse::<Language>(), Ok(Language::Node));
        let err = "ruby".parse::<Language>().expect_err("not supported");
        assert!(err.contains("python, bash or node"), "{err}");
    }

    #[test]
    fn events_decode() {
        let done: Event = serde_json::from_str(
            r#"{"type":"done","execution_count":3,"result":{"text/plain":"42"},"displays":[],"error":null}"#,
        )
        .expect("decodes");
        assert!(matches!(done, Event::Done { execution_count: 3, .. }));
        let stream: Event =
            serde_json::from_str(r#"{"type":"stream","name":"stdout","text":"hi\n"}"#).expect("decodes");
        assert!(matches!(stream, Event::Stream { .. }));
    }

    #[test]
    fn a_failed_snippet_is_named_after_its_exception() {
        let stderr = "/x.js:1\nfoo()\n^\n\nReferenceError: foo is not defined\n    at [eval]:1:1\n\nNode.js v18.19.0\n";
        assert_eq!(last_exception(stderr), Some(("ReferenceError".into(), "foo is not defined".into())));
        assert_eq!(last_exception("bash: line 1: nope: command not found\n"), None);
        let process = Output {
            stdout: Vec::new(),
            stderr: b"boom\n".to_vec(),
            status: moat_proto::ExitStatus {
                code: Some(3),
                signal: None,
                timed_out: false,
                duration_ms: 1,
                dropped_bytes: 0,
            },
            truncated: false,
        };
        let output = CodeOutput::from_process(Some(process), Duration::from_secs(1));
        let error = output.error.expect("a non-zero exit is an error");
        assert_eq!((error.name.as_str(), error.value.as_str()), ("NonZeroExit", "exited with status 3"));
    }

    #[test]
    fn a_stopped_cell_says_what_happened_to_the_state() {
        let kept = Stop::Timeout(Duration::from_secs(7)).error(false, "tb".into());
        assert_eq!(kept.name, "TimeoutError");
        assert!(kept.value.contains("7 s") && kept.value.contains("kept"), "{}", kept.value);
        let lost = Stop::Cancelled.error(true, String::new());
        assert!(lost.value.contains("stopped"), "{}", lost.value);
    }
}
