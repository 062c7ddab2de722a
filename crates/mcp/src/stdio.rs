//! MCP over stdin/stdout, one JSON-RPC message per line, where every
//! message gets an answer.
//!
//! rmcp's own stdio transport drops a line longer than its limit with a log
//! line and ignores input that is not JSON, so a client that sent either
//! waits for ever. This one answers instead:
//!
//! - a line over [`MAX_MESSAGE_BYTES`] gets an "Invalid Request" error with
//!   the request's id (found by [`IdScanner`] while the rest of the line is
//!   skipped, so memory stays bounded) that names the limit and
//!   `copy_to_sandbox`;
//! - a line that is not JSON gets a "Parse error" (id null);
//! - JSON that is not a valid message gets "Invalid Request" with its id,
//!   unless it is a notification (no id), which JSON-RPC never answers.
//!
//! Unknown methods, params of the wrong shape and bad tool arguments parse
//! as messages and are answered by the server (`on_custom_request`, the
//! argument check).

use std::sync::Arc;

use rmcp::RoleServer;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::Mutex;

use crate::limits::{
    INVALID_REQUEST, IdScanner, MAX_MESSAGE_BYTES, PARSE_ERROR, error_response, find_id, too_large_response,
};

/// The server side of MCP over a byte stream pair (stdin and stdout).
pub struct StdioTransport<R, W> {
    read: BufReader<R>,
    /// The line read so far. Kept here, not in `read_line`, because
    /// `receive` is polled in a `select!` and may be dropped mid-line.
    line: Vec<u8>,
    /// Set while the rest of an oversized line is skipped.
    skipping: Option<Skipping>,
    write: Arc<Mutex<Option<W>>>,
    max: usize,
}

impl<R, W> std::fmt::Debug for StdioTransport<R, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StdioTransport").field("max", &self.max).finish_non_exhaustive()
    }
}

/// An oversized line being skipped.
struct Skipping {
    scanner: IdScanner,
    seen: usize,
}

enum LineRead {
    Line,
    Oversized { id: Option<Value>, seen: usize },
    Eof,
    Io(std::io::Error),
}

/// What a complete message turned out to be.
pub(crate) enum Parsed {
    Message(Box<RxJsonRpcMessage<RoleServer>>),
    Reply(Value),
    Ignore,
}

/// This process's stdin, read as the transport reads it.
pub type Input = Box<dyn AsyncRead + Send + Unpin>;
/// This process's stdout, written as the transport writes it.
pub type Output = Box<dyn AsyncWrite + Send + Unpin>;

impl StdioTransport<Input, Output> {
    /// The transport over this process's stdin and stdout: read and
    /// written in the reactor where they are pipes, as MCP clients start
    /// servers. tokio's own `stdin()` and `stdout()` hand every read and
    /// write to a blocking thread and back, two thread wake-ups per
    /// message each way (measured: about a tenth of a `run_command`'s
    /// round trip); they remain for a terminal or a file.
    pub fn stdio() -> Self {
        Self::new(input(), output())
    }
}

/// Stdin as a non-blocking pipe where it is one, else tokio's.
fn input() -> Input {
    match fifo(0).and_then(|file| tokio::net::unix::pipe::Receiver::from_file(file).ok()) {
        Some(pipe) => Box::new(pipe),
        None => Box::new(tokio::io::stdin()),
    }
}

/// Stdout as a non-blocking pipe where it is one, else tokio's.
fn output() -> Output {
    match fifo(1).and_then(|file| tokio::net::unix::pipe::Sender::from_file(file).ok()) {
        Some(pipe) => Box::new(pipe),
        None => Box::new(tokio::io::stdout()),
    }
}

/// A copy of descriptor `fd` (0 or 1) when it is a pipe. A copy, so that
/// the transport closing it leaves the descriptor itself to the process;
/// the copy shares its file description (and so its non-blocking mode,
/// which only this process's reads and writes see: the client holds the
/// pipe's other end).
fn fifo(fd: std::os::fd::RawFd) -> Option<std::fs::File> {
    use std::os::fd::BorrowedFd;
    // SAFETY: 0 and 1 are open for the life of the process (the caller
    // asks only for those); borrowed only to duplicate.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let file = std::fs::File::from(borrowed.try_clone_to_owned().ok()?);
    let is_fifo = std::os::unix::fs::FileTypeExt::is_fifo(&file.metadata().ok()?.file_type());
    is_fifo.then_some(file)
}

impl<R, W> StdioTransport<R, W>
where
    R: AsyncRead + Send + Unpin,
    W: AsyncWrite + Send + Unpin + 'static,
{
    pub fn new(read: R, write: W) -> Self {
        Self {
            read: BufReader::new(read),
            line: Vec::new(),
            skipping: None,
            write: Arc::new(Mutex::new(Some(write))),
            max: MAX_MESSAGE_BYTES,
        }
    }

    /// Reads one line into `self.line`, never holding more than `self.max`
    /// bytes of it. Cancel-safe: the only await is `fill_buf`, and what is
    /// taken from the buffer is recorded before the next one.
    async fn read_line(&mut self) -> LineRead {
        loop {
            let available = match self.read.fill_buf().await {
                Ok(available) => available,
                Err(e) => return LineRead::Io(e),
            };
            if available.is_empty() {
                return LineRead::Eof;
            }
            let newline = available.iter().position(|b| *b == b'\n');
            let take = newline.map_or(available.len(), |i| i + 1);
            let chunk = &available[..take];
            let mut finished = None;
            let mut whole = false;
            if let Some(skipping) = self.skipping.as_mut() {
                skipping.scanner.feed(chunk);
                skipping.seen = skipping.seen.saturating_add(take);
                if newline.is_some() {
                    finished = self.skipping.take();
                }
            } else if self.line.len().saturating_add(take) > self.max {
                let mut scanner = IdScanner::new();
                scanner.feed(&self.line);
                scanner.feed(chunk);
                let skipping = Skipping { scanner, seen: self.line.len() + take };
                // Give the memory back: the line may have been near the limit.
                self.line = Vec::new();
                if newline.is_some() {
                    finished = Some(skipping);
                } else {
                    self.skipping = Some(skipping);
                }
            } else {
                self.line.extend_from_slice(chunk);
                whole = newline.is_some();
            }
            self.read.consume(take);
            if whole {
                return LineRead::Line;
            }
            if let Some(Skipping { scanner, seen }) = finished {
                return LineRead::Oversized { id: scanner.id(), seen };
            }
        }
    }

    /// Writes `answer` in a task of its own: `receive` may be cancelled at
    /// any await, and an answer half written would corrupt the stream.
    fn answer(&self, answer: &Value) {
        let mut bytes = answer.to_string().into_bytes();
        bytes.push(b'\n');
        let write = self.write.clone();
        tokio::spawn(async move {
            if let Err(e) = write_line(&write, &bytes).await {
                tracing::warn!("cannot answer a message that was not processed: {e}");
            }
        });
    }
}

async fn write_line<W: AsyncWrite + Unpin>(write: &Mutex<Option<W>>, bytes: &[u8]) -> std::io::Result<()> {
    let mut write = write.lock().await;
    let Some(write) = write.as_mut() else {
        return Err(std::io::Error::new(std::io::ErrorKind::NotConnected, "the stdio transport is closed"));
    };
    write.write_all(bytes).await?;
    write.flush().await
}

/// Parses one message (a line without its newline, or an HTTP body).
pub(crate) fn parse(line: &[u8]) -> Parsed {
    let line = line.strip_prefix(b"\xEF\xBB\xBF".as_slice()).unwrap_or(line);
    if line.iter().all(u8::is_ascii_whitespace) {
        return Parsed::Ignore;
    }
    let error = match serde_json::from_slice::<RxJsonRpcMessage<RoleServer>>(line) {
        Ok(message) => return Parsed::Message(Box::new(message)),
        Err(e) => e,
    };
    let value = match serde_json::from_slice::<Value>(line) {
        Ok(value) => value,
        Err(e) => {
            tracing::info!("answered a message that is not JSON: {e}");
            // JSON up to a point (nested past the parser's depth, a bad
            // escape, invalid UTF-8): the id, where a scan finds it, lets
            // the client match the answer to its request instead of waiting.
            return Parsed::Reply(error_response(
                find_id(line).filter(|id| id.is_number() || id.is_string()),
                PARSE_ERROR,
                format!("Parse error: the message is not valid JSON ({e}); send one JSON-RPC 2.0 object per line"),
            ));
        }
    };
    let id = value.get("id").filter(|id| id.is_number() || id.is_string()).cloned();
    if let Some(bad) = value.get("id").filter(|_| id.is_none()) {
        // A request whose id no answer can carry: answered (with id null,
        // as JSON-RPC says), not taken for a notification, which has none.
        let kind = match bad {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Array(_) => "an array",
            _ => "an object",
        };
        tracing::info!("answered a message whose id is {kind}");
        return Parsed::Reply(error_response(
            None,
            INVALID_REQUEST,
            format!(
                "Invalid Request: \"id\" must be a string or an integer, not {kind} (a notification has no \"id\" \
                 member at all)"
            ),
        ));
    }
    if id.is_none() && value.get("method").is_some_and(Value::is_string) {
        // A notification, or something the client means as one: JSON-RPC
        // never answers those (rmcp drops unknown ones the same way).
        tracing::debug!("ignored a notification that is not a valid MCP message: {error}");
        return Parsed::Ignore;
    }
    tracing::info!("answered an invalid message: {error}");
    Parsed::Reply(error_response(id, INVALID_REQUEST, invalid_request_message(&value, &error)))
}

/// Says what is wrong with `value`, a JSON value that is not a message.
fn invalid_request_message(value: &Value, error: &serde_json::Error) -> String {
    let Some(object) = value.as_object() else {
        return "Invalid Request: a message must be a JSON-RPC 2.0 object (batches are not supported)".into();
    };
    if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return "Invalid Request: \"jsonrpc\" must be \"2.0\"".into();
    }
    match object.get("method") {
        Some(Value::String(method)) => {
            format!(
                "Invalid Request: the params of {method:?} do not match the MCP specification ({error}); \
                 see tools/list for the tools and their arguments"
            )
        }
        Some(_) => "Invalid Request: \"method\" must be a string".into(),
        None => format!("Invalid Request: not a request, notification or response ({error})"),
    }
}

impl<R, W> Transport<RoleServer> for StdioTransport<R, W>
where
    R: AsyncRead + Send + Unpin,
    W: AsyncWrite + Send + Unpin + 'static,
{
    type Error = std::io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let write = self.write.clone();
        let bytes = serde_json::to_vec(&item).map(|mut bytes| {
            bytes.push(b'\n');
            bytes
        });
        async move { write_line(&write, &bytes.map_err(std::io::Error::from)?).await }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        loop {
            match self.read_line().await {
                LineRead::Line => {}
                LineRead::Oversized { id, seen } => {
                    tracing::warn!(
                        bytes = seen,
                        limit = self.max,
                        "answered a message over the size limit with an error (not processed)"
                    );
                    self.answer(&too_large_response(id, seen));
                    continue;
                }
                LineRead::Eof => return None,
                LineRead::Io(e) => {
                    tracing::error!("cannot read stdin: {e}");
                    return None;
                }
            }
            let line = self.line.strip_suffix(b"\n").unwrap_or(&self.line);
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let parsed = parse(line);
            self.line.clear();
            match parsed {
                Parsed::Message(message) => return Some(*message),
                Parsed::Reply(answer) => self.answer(&answer),
                Parsed::Ignore => {}
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        let mut write = self.write.lock().await;
        if let Some(mut write) = write.take() {
            write.flush().await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A transport over in-memory pipes with a small limit; returns it, the
    /// client's writer and the client's reader.
    fn pipe(
        max: usize,
    ) -> (
        StdioTransport<tokio::io::DuplexStream, tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
        tokio::io::DuplexStream,
    ) {
        let (client_in, server_in) = tokio::io::duplex(64 * 1024);
        let (server_out, client_out) = tokio::io::duplex(64 * 1024);
        let mut transport = StdioTransport::new(server_in, server_out);
        transport.max = max;
        (transport, client_in, client_out)
    }

    async fn next_answer(out: &mut tokio::io::DuplexStream) -> Value {
        let mut bytes = Vec::new();
        let mut byte = [0u8; 1];
        let read = async {
            while out.read_exact(&mut byte).await.is_ok() && byte[0] != b'\n' {
                bytes.push(byte[0]);
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), read).await.expect("an answer within 10 s");
        serde_json::from_slice(&bytes).expect("an answer is one JSON line")
    }

    #[tokio::test]
    async fn an_oversized_line_is_answered_and_the_next_one_served() {
        let (mut transport, mut input, mut output) = pipe(1024);
        let writer = tokio::spawn(async move {
            let big = "x".repeat(200_000);
            let line = format!(
                "{{\"jsonrpc\":\"2.0\",\"method\":\"tools/call\",\"params\":{{\"name\":\"write_file\",\"arguments\":{{\"content\":\"{big}\"}}}},\"id\":5}}\n"
            );
            input.write_all(line.as_bytes()).await.expect("write");
            input.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":6,\"method\":\"ping\"}\n").await.expect("write");
            input
        });
        let message = transport.receive().await.expect("the ping after it");
        assert!(
            matches!(message, rmcp::model::JsonRpcMessage::Request(ref r) if r.id == rmcp::model::RequestId::Number(6))
        );
        let answer = next_answer(&mut output).await;
        assert_eq!(answer["id"], 5);
        assert_eq!(answer["error"]["code"], INVALID_REQUEST);
        let text = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(text.contains("copy_to_sandbox") && text.contains(&MAX_MESSAGE_BYTES.to_string()), "{text}");
        assert!(transport.line.capacity() <= 1024 && transport.skipping.is_none());
        drop(writer.await);
    }

    #[tokio::test]
    async fn malformed_lines_are_answered() {
        let (mut transport, mut input, mut output) = pipe(1024);
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let mut lines = b"not json\n\
              {\"jsonrpc\":\"2.0\",\"id\":\"a\",\"method\":\"tools/call\",\"params\":\"x\"}\n\
              {\"jsonrpc\":\"2.0\",\"method\":\"notifications/whatever\"}\n\
              [1,2]\n\
              {\"jsonrpc\":\"2.0\",\"id\":null,\"method\":\"ping\"}\n\
              {\"jsonrpc\":\"2.0\",\"id\":{\"a\":1},\"method\":\"ping\"}\n"
            .to_vec();
        lines.extend(
            format!("{{\"jsonrpc\":\"2.0\",\"id\":33,\"method\":\"ping\",\"params\":{{\"x\":{deep}}}}}\n").bytes(),
        );
        lines.extend(b"{\"jsonrpc\":\"2.0\",\"id\":34,\"method\":\"ping\",\"params\":{\"x\":\"\xff\"}}\n");
        lines.extend(b"{\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"ping\"}\n");
        input.write_all(&lines).await.expect("write");
        // The unknown notification passes (the server ignores it), then the ping.
        let notification = transport.receive().await.expect("the notification");
        assert!(matches!(notification, rmcp::model::JsonRpcMessage::Notification(_)));
        let message = transport.receive().await.expect("the ping");
        assert!(matches!(message, rmcp::model::JsonRpcMessage::Request(_)));
        let parse = next_answer(&mut output).await;
        assert_eq!((parse["id"].clone(), parse["error"]["code"].clone()), (Value::Null, PARSE_ERROR.into()));
        let args = next_answer(&mut output).await;
        assert_eq!(args["id"], "a");
        assert!(args["error"]["message"].as_str().unwrap_or_default().contains("tools/call"), "{args}");
        let batch = next_answer(&mut output).await;
        assert_eq!(batch["error"]["code"], INVALID_REQUEST);
        // A request with an id no answer can carry is answered, not ignored.
        for kind in ["null", "an object"] {
            let bad_id = next_answer(&mut output).await;
            assert_eq!((bad_id["id"].clone(), bad_id["error"]["code"].clone()), (Value::Null, INVALID_REQUEST.into()));
            assert!(bad_id["error"]["message"].as_str().unwrap_or_default().contains(kind), "{bad_id}");
        }
        // Nested past the parser's depth, and not UTF-8: parse errors that
        // carry the request's id.
        for id in [33, 34] {
            let parse = next_answer(&mut output).await;
            assert_eq!(
                (parse["id"].clone(), parse["error"]["code"].clone()),
                (id.into(), PARSE_ERROR.into()),
                "{parse}"
            );
        }
    }
}
