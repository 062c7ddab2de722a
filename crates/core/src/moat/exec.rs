//! Running processes in a sandbox: `exec`, `run`, `exec_streaming`,
//! `run_code`, and the helpers that stream a process's output and bound the
//! wait for its agent.

use std::time::Duration;

use moat_proto::{AgentClient, ExecHandle, ExecRequest, Output, UnixConnector};

use super::Moat;
use crate::error::SandboxError;
use crate::interpreter::{CodeOutput, Language, PythonSession, StreamName, snippet_request};
use crate::sandbox::NetworkPolicy;
use crate::task::{self, LogEntry};
use crate::timing::{ANSWER_GRACE, now};

/// The most [`Moat::run`] collects of each of stdout and stderr; what a
/// sandbox prints beyond is dropped by its agent (stream with
/// [`Moat::exec`] for more).
pub const RUN_OUTPUT_LIMIT: usize = 64 << 20;

/// The most [`Moat::exec_streaming`] and [`Moat::run_code`] keep of each
/// of stdout and stderr: a hundred pages of a tool's 100,000-character
/// text. The agent reads what a command prints beyond and drops it, so an
/// output flood spends the sandbox's CPU and never the host's memory.
pub const COMMAND_OUTPUT_LIMIT: usize = 8 << 20;

/// A command for [`Moat::exec_streaming`], with what goes with it.
#[derive(Debug, Clone)]
pub struct StreamedCommand {
    /// What runs, and what the task's execution log records. Its
    /// `timeout_ms`, when set, also bounds the wait for the agent: silence
    /// [`ANSWER_GRACE`] past it is [`SandboxError::Unresponsive`].
    pub request: ExecRequest,
    /// The same command as an argv that needs no shell, tried first; when
    /// it cannot start (no such program), `request` runs instead, so that
    /// the caller gets the shell's answer ("command not found", status 127).
    pub direct: Option<Vec<String>>,
    /// Written to the process's stdin, which is then closed; without it the
    /// process gets no stdin.
    pub stdin: Option<Vec<u8>>,
}

/// How a command of [`Moat::exec_streaming`] ended.
#[derive(Debug)]
pub enum ExecOutcome {
    /// The process exited or was killed at its timeout; its output holds at
    /// most [`RUN_OUTPUT_LIMIT`] bytes of each stream.
    Finished(Output),
    /// The caller cancelled: the process and everything it started were
    /// killed.
    Cancelled,
}

/// `work`, given up as [`SandboxError::Unresponsive`] when it has not finished
/// [`ANSWER_GRACE`] after `timeout` (never without a timeout).
pub(crate) async fn answered_within<T>(
    id: &str,
    timeout: Option<Duration>,
    work: impl Future<Output = Result<T, SandboxError>>,
) -> Result<T, SandboxError> {
    let Some(timeout) = timeout else { return work.await };
    crate::timing::within(id, timeout.saturating_add(ANSWER_GRACE), work).await?
}

impl Moat {
    /// Starts a process as `user` in `/home/user` unless the request says otherwise.
    /// The CA variables of `MOAT_CA_FILE` (when set) and a `filtered`
    /// sandbox's proxy variables come first, then the sandbox's
    /// `env`; the request's own variables override both.
    pub async fn exec(&self, id: &str, request: ExecRequest) -> Result<ExecHandle, SandboxError> {
        let client = self.client(id).await?;
        self.exec_through(id, client, request).await
    }

    /// [`Moat::exec`] through `client` (one of [`Moat::client`]'s, or a
    /// [`Moat::resident_client`] for a process that is not a call).
    async fn exec_through(
        &self,
        id: &str,
        client: AgentClient<UnixConnector>,
        mut request: ExecRequest,
    ) -> Result<ExecHandle, SandboxError> {
        request.user.get_or_insert_with(|| "user".into());
        let spec = self.get(id)?.spec;
        let mut spec_env = spec.env;
        if spec.network == NetworkPolicy::Filtered {
            spec_env = crate::net::egress::proxy_env().into_iter().chain(spec_env).collect();
        }
        if self.inner.config.extra_ca.is_some() {
            spec_env = crate::trust::ExtraCa::env().into_iter().chain(spec_env).collect();
        }
        if !spec_env.is_empty() {
            request.env = spec_env.into_iter().chain(std::mem::take(&mut request.env)).collect();
        }
        match client.exec(request).await {
            Ok(handle) => Ok(handle),
            Err(source) => Err(self.agent_error(id, source).await),
        }
    }

    /// Runs a process to completion and collects its output. In a task's
    /// sandbox, the command goes into the task's execution log.
    /// With a `timeout_ms`, an agent that has not answered
    /// [`ANSWER_GRACE`] past it is [`SandboxError::Unresponsive`].
    pub async fn run(&self, id: &str, mut request: ExecRequest) -> Result<Output, SandboxError> {
        // What the agent is asked to keep, and all the host keeps of what
        // it sends: an agent that ignores the limit gets no further.
        let limit = (*request.output_limit.get_or_insert(RUN_OUTPUT_LIMIT as u64)).min(RUN_OUTPUT_LIMIT as u64);
        let command = command_line(&request);
        let started_at = now();
        let timeout = request.timeout_ms.map(Duration::from_millis);
        let work = async {
            self.exec(id, request)
                .await?
                .output_limited(usize::try_from(limit).unwrap_or(RUN_OUTPUT_LIMIT))
                .await
                .map_err(|source| SandboxError::Agent { id: id.into(), source })
        };
        let output = self.explained(id, answered_within(id, timeout, work).await).await?;
        self.log_command(id, &command, started_at, &output);
        Ok(output)
    }

    /// Runs a command in sandbox `id`, handing its output to `on_output` as
    /// it comes, until it exits, reaches its timeout, or `cancelled`
    /// completes (which kills it and everything it started). In a task's
    /// sandbox, a finished command goes into the task's execution log.
    /// An agent that has not answered [`ANSWER_GRACE`] past the request's
    /// `timeout_ms` is [`SandboxError::Unresponsive`]; a sandbox that died
    /// meanwhile is [`SandboxError::Failed`].
    pub async fn exec_streaming(
        &self,
        id: &str,
        command: StreamedCommand,
        on_output: &(dyn Fn(StreamName, &[u8]) + Sync),
        cancelled: impl Future<Output = ()>,
    ) -> Result<ExecOutcome, SandboxError> {
        let StreamedCommand { mut request, direct, stdin } = command;
        request.stdin = stdin.is_some();
        request.output_limit = Some(COMMAND_OUTPUT_LIMIT as u64);
        let logged = command_line(&request);
        let started_at = now();
        let timeout = request.timeout_ms.map(Duration::from_millis);
        let work = async {
            let first = direct.map(|argv| ExecRequest { command: moat_proto::Command::Argv(argv), ..request.clone() });
            let mut handle = match first {
                Some(first) => match self.exec(id, first).await {
                    Ok(handle) => handle,
                    Err(_) => self.exec(id, request).await?,
                },
                None => self.exec(id, request).await?,
            };
            if let Some(input) = stdin
                && let Some(mut pipe) = handle.take_stdin()
            {
                tokio::spawn(async move {
                    let _ = pipe.write(input.into()).await;
                    let _ = pipe.close().await;
                });
            }
            stream_output(handle, COMMAND_OUTPUT_LIMIT, cancelled, on_output)
                .await
                .map_err(|source| SandboxError::Agent { id: id.into(), source })
        };
        let streamed = self.explained(id, answered_within(id, timeout, work).await).await?;
        let Some(output) = streamed else { return Ok(ExecOutcome::Cancelled) };
        self.log_command(id, &logged, started_at, &output);
        Ok(ExecOutcome::Finished(output))
    }

    /// Runs `code` in sandbox `id` like a notebook cell (see
    /// [`interpreter`](crate::interpreter)): Python in the sandbox's
    /// persistent session, bash and node as one process each. Output text
    /// reaches `on_stream` as it comes. When `cancelled` completes, the
    /// code is interrupted (Python) or killed. Errors of the code are
    /// data in the output; `Err` means the sandbox could not run it.
    pub async fn run_code(
        &self,
        id: &str,
        language: Language,
        code: &str,
        timeout: Duration,
        cancelled: impl Future<Output = ()>,
        on_stream: &(dyn Fn(StreamName, &[u8]) + Sync),
    ) -> Result<CodeOutput, SandboxError> {
        let started_at = now();
        let output = self.explained(id, self.run_cell(id, language, code, timeout, cancelled, on_stream).await).await?;
        let as_command = Output {
            stdout: output.stdout.clone(),
            stderr: output.stderr.clone(),
            status: moat_proto::ExitStatus {
                code: Some(i32::from(output.error.is_some())),
                signal: None,
                timed_out: output.error.as_ref().is_some_and(|e| e.name == "TimeoutError"),
                duration_ms: now().saturating_sub(started_at) * 1000,
                dropped_bytes: 0,
            },
            truncated: output.truncated,
        };
        self.log_command(id, &format!("run_code {language:?}: {code}"), started_at, &as_command);
        Ok(output)
    }

    /// One cell of [`Moat::run_code`], before its errors are explained.
    async fn run_cell(
        &self,
        id: &str,
        language: Language,
        code: &str,
        timeout: Duration,
        cancelled: impl Future<Output = ()>,
        on_stream: &(dyn Fn(StreamName, &[u8]) + Sync),
    ) -> Result<CodeOutput, SandboxError> {
        Ok(match language {
            Language::Python => {
                let session = {
                    let sandboxes = self.inner.lock();
                    sandboxes.get(id).map(|e| e.python.clone()).ok_or_else(|| self.inner.unknown(id, &sandboxes))?
                };
                let mut session = session.lock().await;
                let running = match session.as_mut() {
                    Some(running) => {
                        // Resumes a suspended sandbox and marks it used.
                        self.client(id).await?;
                        running
                    }
                    None => {
                        // Bounded as a command is: the runner is given the
                        // cell's timeout and the grace after it to be ready.
                        // The session's runner stays connected between
                        // cells, which is no use of the sandbox.
                        let client = self.resident_client(id).await?;
                        let start = self.exec_through(id, client, PythonSession::request());
                        let handle = answered_within(id, Some(timeout), start).await?;
                        let started = PythonSession::start(handle, timeout.saturating_add(ANSWER_GRACE))
                            .await
                            .map_err(|e| SandboxError::CodeSession { id: id.into(), reason: e.to_string() })?;
                        session.insert(started)
                    }
                };
                let (output, alive) = running.execute(code, timeout, cancelled, COMMAND_OUTPUT_LIMIT, on_stream).await;
                if !alive {
                    *session = None;
                    // The session's end may be the sandbox's.
                    if let Some(failed) = self.settled_failure(id).await {
                        return Err(failed);
                    }
                }
                output
            }
            snippet => {
                let mut request = snippet_request(snippet, code);
                request.timeout_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
                request.output_limit = Some(COMMAND_OUTPUT_LIMIT as u64);
                // (Python's session bounds its own wait: interrupted at the
                // timeout, dropped when that is not answered.)
                let streamed = answered_within(id, Some(timeout), async {
                    let handle = self.exec(id, request).await?;
                    stream_output(handle, COMMAND_OUTPUT_LIMIT, cancelled, on_stream)
                        .await
                        .map_err(|source| SandboxError::Agent { id: id.into(), source })
                })
                .await?;
                CodeOutput::from_process(streamed, timeout)
            }
        })
    }

    /// Records a finished command in the execution log of the task that
    /// owns sandbox `id`, if one does. [`Moat::run`],
    /// [`Moat::exec_streaming`] and [`Moat::run_code`] record their own;
    /// this is for commands run through [`Moat::client`] (`git_clone`,
    /// whose output is scrubbed of its credentials first).
    pub fn log_command(&self, id: &str, command: &str, started_at: u64, output: &Output) {
        let mut tasks = self.inner.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, log)) = tasks.values_mut().find(|(task, _)| task.sandbox_id == id) {
            let (command, cut_command) = task::clip(command.as_bytes());
            let (stdout, cut_out) = task::clip(&output.stdout);
            let (stderr, cut_err) = task::clip(&output.stderr);
            if log.len() >= task::LOG_ENTRIES {
                log.remove(0);
            }
            log.push(LogEntry {
                command,
                exit_code: output.status.code,
                signal: output.status.signal,
                started_at,
                duration_ms: output.status.duration_ms,
                stdout,
                stderr,
                truncated: cut_command || cut_out || cut_err,
            });
        }
    }
}

/// What a request runs, in words, for logs.
pub(crate) fn command_line(request: &ExecRequest) -> String {
    match &request.command {
        moat_proto::Command::Shell(script) => script.clone(),
        moat_proto::Command::Argv(argv) => argv.join(" "),
    }
}

/// Collects a process's output (at most `limit` bytes of each stream) while
/// handing each chunk to `on_stream` as it comes. When `cancelled`
/// completes first, the handle is dropped, which kills the process group,
/// and the result is `None`.
pub(crate) async fn stream_output(
    mut handle: ExecHandle,
    limit: usize,
    cancelled: impl Future<Output = ()>,
    on_stream: &(dyn Fn(StreamName, &[u8]) + Sync),
) -> Result<Option<Output>, moat_proto::ProtoError> {
    async fn next_chunk(rx: &mut Option<tokio::sync::mpsc::Receiver<bytes::Bytes>>) -> Option<bytes::Bytes> {
        match rx {
            Some(rx) => rx.recv().await,
            None => std::future::pending().await,
        }
    }
    fn append(buf: &mut Vec<u8>, bytes: &[u8], limit: usize) -> bool {
        let room = limit.saturating_sub(buf.len());
        buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
        bytes.len() > room
    }
    let mut stdout = handle.take_stdout();
    let mut stderr = handle.take_stderr();
    let (mut out, mut err, mut truncated) = (Vec::new(), Vec::new(), false);
    tokio::pin!(cancelled);
    while stdout.is_some() || stderr.is_some() {
        tokio::select! {
            chunk = next_chunk(&mut stdout) => match chunk {
                Some(bytes) => {
                    on_stream(StreamName::Stdout, &bytes);
                    truncated |= append(&mut out, &bytes, limit);
                }
                None => stdout = None,
            },
            chunk = next_chunk(&mut stderr) => match chunk {
                Some(bytes) => {
                    on_stream(StreamName::Stderr, &bytes);
                    truncated |= append(&mut err, &bytes, limit);
                }
                None => stderr = None,
            },
            () = &mut cancelled => return Ok(None),
        }
    }
    let status = handle.wait().await?;
    Ok(Some(Output { stdout: out, stderr: err, status, truncated: truncated || status.dropped_bytes > 0 }))
}
