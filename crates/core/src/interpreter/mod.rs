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
/// images included). The runner is the sandbox's: the cell's own code
/// runs in its process and may write anything to the protocol pipe, so
/// everything read from it is bounded here, not there.
const MAX_EVENT: usize = 64 << 20;

/// The room a session's read buffer keeps between lines.
const PENDING_KEPT: usize = 64 << 10;

/// The most bytes of rich results (displays and the cell's value, images
/// as base64) one cell keeps; later results are left out and said so.
pub const RESULTS_BUDGET: usize = 16 << 20;

/// The most rich results (displays and the cell's value) one cell keeps.
pub const MAX_RESULTS: usize = 64;

/// The most MIME types kept of one result, and the longest type name.
const MAX_MIME_TYPES: usize = 16;
const MAX_MIME_NAME: usize = 128;

/// The largest non-text value of a result (an `application/json` bundle)
/// that is parsed; larger ones are left out (parsing JSON builds a tree
/// many times the size of its text).
const MAX_STRUCTURED: usize = 1 << 20;

/// The longest exception name kept.
const MAX_ERROR_NAME: usize = 256;

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

#[derive(Debug)]
enum Event {
    Ready,
    Stream {
        name: String,
        text: String,
        /// Characters the runner read past the cell's limit and dropped.
        dropped: u64,
    },
    Done {
        execution_count: u64,
        result: Option<RawBundle>,
        displays: Vec<RawBundle>,
        left_out: u64,
        cut: bool,
        error: Option<CodeError>,
    },
}

/// One protocol line as read, before it is known which event it is. A
/// plain struct, not a tagged enum: serde reads a tagged enum's content
/// into a tree first, as large as the line allows, where this reads the
/// fields in place (and bundle values as their text).
#[derive(Deserialize)]
struct Line {
    #[serde(rename = "type")]
    kind: String,
    name: Option<String>,
    text: Option<String>,
    #[serde(default)]
    dropped: u64,
    execution_count: Option<u64>,
    result: Option<ReadBundle>,
    #[serde(default)]
    displays: ReadDisplays,
    /// Displays the runner left out to keep within the bounds it was given.
    #[serde(default)]
    left_out: u64,
    /// The runner cut the value's text or the error's to fit.
    #[serde(default)]
    cut: bool,
    error: Option<CodeError>,
}

impl Event {
    /// The event of one protocol line.
    fn decode(line: &[u8]) -> Result<Self, SessionError> {
        let bad = |why: String| SessionError::Protocol(clip_to(why, 512).0);
        let line: Line = serde_json::from_slice(line).map_err(|e| bad(e.to_string()))?;
        match line.kind.as_str() {
            "ready" => Ok(Self::Ready),
            "stream" => Ok(Self::Stream {
                name: line.name.unwrap_or_default(),
                text: line.text.unwrap_or_default(),
                dropped: line.dropped,
            }),
            "done" => {
                // What reading left out counts with what the runner did.
                let mut left_out = line.left_out.saturating_add(line.displays.left_out);
                let mut keep = |bundle: ReadBundle| {
                    left_out = left_out.saturating_add(bundle.left_out);
                    bundle.types
                };
                let displays = line.displays.kept.into_iter().map(&mut keep).collect();
                let result = line.result.map(&mut keep);
                Ok(Self::Done {
                    execution_count: line
                        .execution_count
                        .ok_or_else(|| bad("a done event without execution_count".into()))?,
                    result,
                    displays,
                    left_out,
                    cut: line.cut,
                    error: line.error,
                })
            }
            other => Err(bad(format!("an event of unknown type {other:?}"))),
        }
    }
}

/// A MIME bundle as the runner sent it: each value kept as its JSON text,
/// so that reading it costs no more memory than the line it came in.
type RawBundle = std::collections::BTreeMap<String, Box<serde_json::value::RawValue>>;

/// A bundle as read from a protocol line: at most [`MAX_MIME_TYPES`] types
/// with names of at most [`MAX_MIME_NAME`] bytes, and how many more there
/// were. The rest are skipped as they are read, never built: each entry of
/// a map costs hundreds of bytes of the host's memory for a few of the
/// line's (`{"a":1}`), so a line of tiny bundles or types, which the
/// cell's own code may write, would cost many times its length.
#[derive(Default)]
struct ReadBundle {
    types: RawBundle,
    left_out: u64,
}

impl<'de> Deserialize<'de> for ReadBundle {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Types;
        impl<'de> serde::de::Visitor<'de> for Types {
            type Value = ReadBundle;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a MIME bundle (an object)")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<ReadBundle, A::Error> {
                let mut bundle = ReadBundle::default();
                while let Some(name) = map.next_key::<String>()? {
                    if bundle.types.len() < MAX_MIME_TYPES && name.len() <= MAX_MIME_NAME {
                        let value = map.next_value::<Box<serde_json::value::RawValue>>()?;
                        bundle.types.insert(name, value);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                        bundle.left_out = bundle.left_out.saturating_add(1);
                    }
                }
                Ok(bundle)
            }
        }
        deserializer.deserialize_map(Types)
    }
}

/// Displays as read from a protocol line: the first [`MAX_RESULTS`], and
/// how many more there were (skipped as read, as in [`ReadBundle`]).
#[derive(Default)]
struct ReadDisplays {
    kept: Vec<ReadBundle>,
    left_out: u64,
}

impl<'de> Deserialize<'de> for ReadDisplays {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Bundles;
        impl<'de> serde::de::Visitor<'de> for Bundles {
            type Value = ReadDisplays;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of MIME bundles")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<ReadDisplays, A::Error> {
                let mut displays = ReadDisplays::default();
                while displays.kept.len() < MAX_RESULTS {
                    match seq.next_element::<ReadBundle>()? {
                        Some(bundle) => displays.kept.push(bundle),
                        None => return Ok(displays),
                    }
                }
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    displays.left_out = displays.left_out.saturating_add(1);
                }
                Ok(displays)
            }
        }
        deserializer.deserialize_seq(Bundles)
    }
}

/// Keeps what fits of a cell's rich results: at most [`MAX_RESULTS`]
/// bundles, [`MAX_MIME_TYPES`] types each, [`RESULTS_BUDGET`] bytes in all,
/// structured values up to [`MAX_STRUCTURED`]. Returns the bundles kept and
/// how many whole bundles or values were left out.
fn bounded_results(bundles: impl IntoIterator<Item = RawBundle>) -> (Vec<Map<String, Value>>, usize) {
    let (mut kept, mut left_out, mut budget) = (Vec::new(), 0usize, RESULTS_BUDGET);
    for bundle in bundles {
        if kept.len() == MAX_RESULTS {
            left_out += 1;
            continue;
        }
        let mut map = Map::new();
        for (mime, raw) in bundle {
            let text = raw.get();
            if map.len() == MAX_MIME_TYPES || mime.len() > MAX_MIME_NAME || text.len() > budget {
                left_out += 1;
                continue;
            }
            let value = if text.starts_with('"') {
                serde_json::from_str::<String>(text).ok().map(Value::String)
            } else if text.len() <= MAX_STRUCTURED {
                serde_json::from_str::<Value>(text).ok()
            } else {
                None
            };
            match value {
                Some(value) => {
                    budget -= text.len();
                    map.insert(mime, value);
                }
                None => left_out += 1,
            }
        }
        if !map.is_empty() {
            kept.push(map);
        }
    }
    (kept, left_out)
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn clip_to(mut text: String, max: usize) -> (String, bool) {
    if text.len() <= max {
        return (text, false);
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    (text, true)
}

impl CodeError {
    /// The error with its name, value and traceback cut to sizes a result
    /// can carry (`limit` bytes each for the value and the traceback).
    fn bounded(self, limit: usize) -> (Self, bool) {
        let (name, a) = clip_to(self.name, MAX_ERROR_NAME);
        let (value, b) = clip_to(self.value, limit);
        let (traceback, c) = clip_to(self.traceback, limit);
        (Self { name, value, traceback }, a || b || c)
    }
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
    /// How much of `pending` is known to hold no newline.
    scanned: usize,
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
        let mut session = Self { handle, stdin, stdout, pending: Vec::new(), scanned: 0, diagnostics };
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
        let request = serde_json::json!({
            "code": code, "limit": limit, "max_results": MAX_RESULTS, "results_budget": RESULTS_BUDGET,
        });
        let line = request.to_string() + "\n";
        let deadline = tokio::time::Instant::now() + timeout;
        // Every wait of a cell ends by one deadline: the timeout, then once
        // interrupted the grace after it, however the cell goes on (one
        // that catches KeyboardInterrupt and keeps printing is dropped at
        // the grace's end, not waited on event by event).
        let gone = |stop: Stop| SessionError::Interrupted(stop.error(true, String::new()));
        match tokio::time::timeout_at(deadline, self.stdin.write(Bytes::from(line))).await {
            Ok(written) => written.map_err(|_| self.ended())?,
            Err(_) => return Err(gone(Stop::Timeout(timeout))),
        }
        let deadline = tokio::time::sleep_until(deadline);
        tokio::pin!(deadline);
        tokio::pin!(cancelled);
        let mut stop: Option<(Stop, tokio::time::Instant)> = None;
        loop {
            let event = match stop {
                Some((stop, grace_end)) => match tokio::time::timeout_at(grace_end, self.next_event()).await {
                    Ok(event) => event?,
                    Err(_) => return Err(gone(stop)),
                },
                None => {
                    let why = tokio::select! {
                        event = self.next_event() => Err(event),
                        () = &mut deadline => Ok(Stop::Timeout(timeout)),
                        () = &mut cancelled => Ok(Stop::Cancelled),
                    };
                    match why {
                        Err(event) => event?,
                        Ok(why) => {
                            let grace_end = tokio::time::Instant::now() + INTERRUPT_GRACE;
                            if tokio::time::timeout_at(grace_end, self.interrupt()).await.is_err() {
                                return Err(gone(why));
                            }
                            stop = Some((why, grace_end));
                            continue;
                        }
                    }
                }
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
                Event::Done { execution_count, result, displays, left_out: left_by_runner, cut, error } => {
                    output.execution_count = Some(execution_count);
                    output.truncated |= cut;
                    let mut result = result.unwrap_or_default();
                    if let Some(raw) = result.remove("text/plain") {
                        let text = serde_json::from_str::<String>(raw.get()).unwrap_or_default();
                        let (text, cut) = clip_to(text, limit);
                        output.text = text;
                        output.truncated |= cut;
                    }
                    let value = (!result.is_empty()).then_some(result);
                    let (results, left_out) = bounded_results(displays.into_iter().chain(value));
                    let left_out = usize::try_from(left_by_runner).unwrap_or(usize::MAX).saturating_add(left_out);
                    output.results = results;
                    if left_out > 0 {
                        output.truncated = true;
                        let note = format!(
                            "\nmoat: {left_out} rich result{} (displays, images or MIME types) {} left out: a \
                             cell keeps at most {MAX_RESULTS} results and {} MiB of them; save large outputs to \
                             files instead\n",
                            if left_out == 1 { "" } else { "s" },
                            if left_out == 1 { "was" } else { "were" },
                            RESULTS_BUDGET >> 20
                        );
                        output.stderr.extend_from_slice(note.as_bytes());
                    }
                    let error = error.map(|e| {
                        let (e, cut) = e.bounded(limit);
                        output.truncated |= cut;
                        e
                    });
                    output.error = match stop {
                        Some((stop, _)) => Some(stop.error(false, error.map(|e| e.traceback).unwrap_or_default())),
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
            // Only the bytes not looked at yet are searched: a long line
            // arriving in many chunks is scanned once, not once per chunk.
            if let Some(at) = self.pending[self.scanned..].iter().position(|&b| b == b'\n') {
                let end = self.scanned + at;
                self.scanned = 0;
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                // A long line grew the buffer: give the room back rather
                // than keep it for the session's life.
                if self.pending.capacity() > PENDING_KEPT && self.pending.len() <= PENDING_KEPT {
                    self.pending.shrink_to(PENDING_KEPT);
                }
                return Event::decode(&line);
            }
            self.scanned = self.pending.len();
            if self.pending.len() > MAX_EVENT {
                return Err(SessionError::Protocol(format!(
                    "a message longer than {} MiB: the cell's results (displays, images) are too large; save large \
                     outputs to files instead",
                    MAX_EVENT >> 20
                )));
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
        let done = Event::decode(
            br#"{"type":"done","execution_count":3,"result":{"text/plain":"42"},"displays":[],"error":null}"#,
        )
        .expect("decodes");
        assert!(matches!(done, Event::Done { execution_count: 3, .. }));
        let stream = Event::decode(br#"{"type":"stream","name":"stdout","text":"hi\n"}"#).expect("decodes");
        assert!(matches!(stream, Event::Stream { .. }));
        assert!(matches!(Event::decode(br#"{"type":"ready"}"#), Ok(Event::Ready)));
        let unknown = Event::decode(format!(r#"{{"type":"{}"}}"#, "x".repeat(4096)).as_bytes()).expect_err("unknown");
        assert!(unknown.to_string().len() < 700, "a bad line is not echoed whole: {unknown}");
    }

    /// Counts what this thread holds of the heap, and the most it held,
    /// so that a test can see how much memory a call took.
    struct Counting;

    thread_local! {
        static HELD: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
        static MOST: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
    }

    fn note(change: isize) {
        let _ = HELD.try_with(|held| {
            let now = held.get() + change;
            held.set(now);
            let _ = MOST.try_with(|most| most.set(most.get().max(now)));
        });
    }

    // SAFETY: every call goes to the system allocator with the same
    // arguments; the counting touches only `const` thread-locals, which
    // never allocate.
    unsafe impl std::alloc::GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
            note(layout.size().cast_signed());
            // SAFETY: the caller's contract, passed on.
            unsafe { std::alloc::System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
            note(layout.size().cast_signed());
            // SAFETY: the caller's contract, passed on.
            unsafe { std::alloc::System.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
            note(-layout.size().cast_signed());
            // SAFETY: the caller's contract, passed on.
            unsafe { std::alloc::System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
            note(size.cast_signed() - layout.size().cast_signed());
            // SAFETY: the caller's contract, passed on.
            unsafe { std::alloc::System.realloc(ptr, layout, size) }
        }
    }

    // This crate's unit tests only.
    #[global_allocator]
    static COUNTING: Counting = Counting;

    /// The most of the heap `work` took beyond what this thread held.
    fn most_taken<T>(work: impl FnOnce() -> T) -> (T, isize) {
        let before = HELD.with(std::cell::Cell::get);
        MOST.with(|most| most.set(before));
        let out = work();
        (out, MOST.with(std::cell::Cell::get) - before)
    }

    /// A line of a million tiny displays, or of one display with a
    /// million tiny types, which a cell's own code can write to the
    /// protocol pipe: read as the first few, the rest counted, never built.
    /// Built, each took the host some 500 bytes for 8 of the line's: a
    /// 64 MiB line, about 4 GiB.
    #[test]
    fn a_line_of_tiny_bundles_or_types_is_read_without_building_them() {
        let line =
            format!(r#"{{"type":"done","execution_count":1,"displays":[{}{{}}]}}"#, r#"{"a":1},"#.repeat(1 << 20));
        let (decoded, taken) = most_taken(|| Event::decode(line.as_bytes()));
        let Ok(Event::Done { displays, left_out, .. }) = decoded else { panic!("decodes") };
        assert_eq!((displays.len(), left_out), (MAX_RESULTS, (1 << 20) + 1 - MAX_RESULTS as u64));
        assert!(taken < 1 << 20, "decoding a {} MiB line took {taken} bytes", line.len() >> 20);
        let types = (0..1 << 20).map(|i| format!(r#""{i}":1"#)).collect::<Vec<_>>().join(",");
        let line = format!(r#"{{"type":"done","execution_count":1,"result":{{{types}}}}}"#);
        let (decoded, taken) = most_taken(|| Event::decode(line.as_bytes()));
        let Ok(Event::Done { result: Some(result), left_out, .. }) = decoded else { panic!("decodes") };
        assert_eq!((result.len(), left_out), (MAX_MIME_TYPES, (1 << 20) - MAX_MIME_TYPES as u64));
        assert!(taken < 1 << 20, "decoding a {} MiB line took {taken} bytes", line.len() >> 20);
    }

    fn bundle(pairs: &[(&str, &str)]) -> RawBundle {
        pairs
            .iter()
            .map(|(mime, json)| {
                ((*mime).to_owned(), serde_json::value::RawValue::from_string((*json).to_owned()).expect("valid JSON"))
            })
            .collect()
    }

    #[test]
    fn a_cells_rich_results_are_bounded() {
        // Within the bounds, everything is kept as sent.
        let (kept, left_out) = bounded_results([bundle(&[("image/png", r#""iVBOR""#), ("application/json", "[1,2]")])]);
        assert_eq!(left_out, 0);
        assert_eq!(kept[0]["image/png"], Value::String("iVBOR".into()));
        assert_eq!(kept[0]["application/json"], serde_json::json!([1, 2]));
        // A thousand displays: the first MAX_RESULTS.
        let many = (0..1000).map(|_| bundle(&[("text/html", r#""<b>x</b>""#)]));
        let (kept, left_out) = bounded_results(many);
        assert_eq!((kept.len(), left_out), (MAX_RESULTS, 1000 - MAX_RESULTS));
        // Images past the byte budget, a structured value too large to
        // parse, too many or too long MIME types.
        let image = format!("\"{}\"", "A".repeat(RESULTS_BUDGET / 3));
        let (kept, left_out) = bounded_results((0..4).map(|_| bundle(&[("image/png", &image)])));
        assert_eq!((kept.len(), left_out), (2, 2), "two fit in the budget");
        let huge = format!("[{}0]", "0,".repeat(MAX_STRUCTURED));
        let types: Vec<(String, String)> = (0..40).map(|i| (format!("x/{i}"), "\"v\"".to_owned())).collect();
        let types: Vec<(&str, &str)> = types.iter().map(|(m, v)| (m.as_str(), v.as_str())).collect();
        let long_name = "x".repeat(MAX_MIME_NAME + 1);
        let (kept, left_out) = bounded_results([
            bundle(&[("application/json", &huge)]),
            bundle(&types),
            bundle(&[(&long_name, "\"v\""), ("text/plain", "\"ok\"")]),
        ]);
        assert_eq!(kept.len(), 2, "the bundle left empty is dropped: {kept:?}");
        assert_eq!(kept[0].len(), MAX_MIME_TYPES);
        assert_eq!(left_out, 1 + (40 - MAX_MIME_TYPES) + 1);
    }

    #[test]
    fn a_cells_error_is_cut_to_the_limit() {
        let error = CodeError { name: "E".repeat(10_000), value: "é".repeat(600), traceback: "t".repeat(5000) };
        let (error, cut) = error.bounded(1001);
        assert!(cut);
        assert_eq!((error.name.len(), error.value.len(), error.traceback.len()), (MAX_ERROR_NAME, 1000, 1001));
        let small = CodeError { name: "ValueError".into(), value: "bad".into(), traceback: String::new() };
        assert_eq!(small.clone().bounded(1000), (small, false));
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
