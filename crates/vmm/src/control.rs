//! The control socket: a Unix stream socket speaking JSON lines.
//!
//! Each request is one JSON object on one line; each gets one JSON object
//! on one line back, in order. The requests and their answers are
//! moat-vmm-api's [`Request`] and [`Reply`] (`status`, `pause`, `resume`,
//! `shutdown`; the table is in [`moat_vmm_api::control`]).
//!
//! A request that cannot be parsed gets `{"ok":false,"error":"…"}` and the
//! connection stays open; a line over 4 KiB closes it.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use serde::Serialize;

pub use moat_vmm_api::control::{Reply, Request, Shutdown, State, Status};

/// Longest request line accepted.
pub const MAX_LINE: usize = 4096;

/// Parses one request line.
pub fn parse(line: &str) -> Result<Request, String> {
    serde_json::from_str(line.trim()).map_err(|e| format!("Bad request: {e}; send e.g. {{\"op\":\"status\"}}"))
}

/// A successful reply carrying `answer`'s fields.
pub fn ok<T: Serialize>(answer: &T) -> String {
    line(&Reply::Done(answer))
}

/// A failure reply.
pub fn error(message: &str) -> String {
    line(&Reply::<()>::Refused(message.into()))
}

fn line<T: Serialize>(reply: &Reply<T>) -> String {
    // Encoding fails only for maps with non-string keys or a failing
    // `Serialize`; no answer has either.
    serde_json::to_string(reply).unwrap_or_default()
}

/// Why the control socket could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0} exists and is not a socket; choose another control socket path")]
    NotASocket(PathBuf),
    #[error("Cannot listen on the control socket {path}")]
    Bind { path: PathBuf, source: std::io::Error },
}

struct Client {
    stream: UnixStream,
    pending: Vec<u8>,
}

/// The listening socket and its connections. Tokens identify connections
/// to the event loop.
pub struct ControlServer {
    path: PathBuf,
    /// Whether dropping the server removes its socket file.
    remove_on_drop: bool,
    listener: UnixListener,
    clients: HashMap<u64, Client>,
    next_token: u64,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer").field("path", &self.path).field("clients", &self.clients.len()).finish()
    }
}

/// What reading a connection produced.
#[derive(Debug, PartialEq, Eq)]
pub enum Incoming {
    /// Complete lines (requests or parse errors), in order.
    Lines(Vec<Result<Request, String>>),
    /// The peer hung up or misbehaved; the connection is gone.
    Closed,
}

impl ControlServer {
    /// Listens at `path`, replacing a stale socket left by a dead VMM.
    pub fn bind(path: &Path, first_token: u64) -> Result<Self, ControlError> {
        use std::os::unix::fs::FileTypeExt;
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(ControlError::NotASocket(path.into()));
            }
            let _ = std::fs::remove_file(path);
        }
        let bind_err = |source| ControlError::Bind { path: path.into(), source };
        let listener = UnixListener::bind(path).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        Ok(Self { path: path.into(), remove_on_drop: true, listener, clients: HashMap::new(), next_token: first_token })
    }

    /// Leaves the socket file in place when the server is dropped (a jailed
    /// VMM may not remove files; its supervisor does).
    pub fn leave_file(&mut self) {
        self.remove_on_drop = false;
    }

    /// The listening socket's fd.
    pub fn listener_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    /// Accepts every waiting connection; returns their (token, fd).
    pub fn accept(&mut self) -> Vec<(u64, RawFd)> {
        let mut accepted = Vec::new();
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let token = self.next_token;
                    self.next_token += 1;
                    accepted.push((token, stream.as_raw_fd()));
                    self.clients.insert(token, Client { stream, pending: Vec::new() });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!("Control socket accept failed: {e}");
                    break;
                }
            }
        }
        accepted
    }

    /// Whether `token` is one of this server's connections.
    pub fn owns(&self, token: u64) -> bool {
        self.clients.contains_key(&token)
    }

    /// Reads what connection `token` sent.
    pub fn read(&mut self, token: u64) -> Incoming {
        let Some(client) = self.clients.get_mut(&token) else { return Incoming::Closed };
        let mut buf = [0u8; 1024];
        let mut hung_up = false;
        loop {
            match client.stream.read(&mut buf) {
                Ok(0) => {
                    hung_up = true;
                    break;
                }
                Ok(n) => client.pending.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    hung_up = true;
                    break;
                }
            }
            // Enough for now: the rest is read on the next readiness event.
            if client.pending.len() > 16 * MAX_LINE {
                break;
            }
            if client.pending.len() > MAX_LINE && !client.pending[..MAX_LINE].contains(&b'\n') {
                let _ = client.stream.write_all(format!("{}\n", error("Request line over 4 KiB")).as_bytes());
                self.clients.remove(&token);
                return Incoming::Closed;
            }
        }
        let mut lines = Vec::new();
        while let Some(end) = client.pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = client.pending.drain(..=end).collect();
            let text = String::from_utf8_lossy(&line);
            if !text.trim().is_empty() {
                lines.push(parse(&text));
            }
        }
        if hung_up && lines.is_empty() {
            self.clients.remove(&token);
            return Incoming::Closed;
        }
        Incoming::Lines(lines)
    }

    /// Sends one reply line to `token` (dropped if the peer is gone).
    pub fn reply(&mut self, token: u64, line: &str) {
        let Some(client) = self.clients.get_mut(&token) else { return };
        let mut out = line.as_bytes().to_vec();
        out.push(b'\n');
        // Replies are small; a peer that does not read them loses them.
        if let Err(e) = write_all_nonblocking(&mut client.stream, &out) {
            tracing::debug!("Control reply lost: {e}");
            self.clients.remove(&token);
        }
    }

    /// Drops connection `token`.
    pub fn close(&mut self, token: u64) {
        self.clients.remove(&token);
    }
}

fn write_all_nonblocking(stream: &mut UnixStream, mut out: &[u8]) -> std::io::Result<()> {
    let mut spins = 0;
    while !out.is_empty() {
        match stream.write(out) {
            Ok(n) => out = &out[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock && spins < 1000 => {
                spins += 1;
                std::thread::yield_now();
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        if self.remove_on_drop {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};

    #[test]
    fn requests_parse() {
        assert_eq!(parse(r#"{"op":"status"}"#), Ok(Request::Status));
        assert_eq!(parse(r#" {"op":"pause"} "#), Ok(Request::Pause));
        assert_eq!(parse(r#"{"op":"shutdown"}"#), Ok(Request::Shutdown { force: false, timeout_ms: None }));
        assert_eq!(
            parse(r#"{"op":"shutdown","force":true,"timeout_ms":10}"#),
            Ok(Request::Shutdown { force: true, timeout_ms: Some(10) })
        );
        let e = parse(r#"{"op":"reboot"}"#).expect_err("unknown op");
        assert!(e.contains("unknown variant `reboot`"), "{e}");
        assert!(parse("status").is_err());
    }

    #[test]
    fn replies_are_single_json_lines() {
        let status = Status { state: State::Running, vcpus: 2, memory_mib: 128, uptime_ms: 5, guest_ready_us: None };
        let line = ok(&status);
        assert!(!line.contains('\n'));
        let value: serde_json::Value = serde_json::from_str(&line).expect("JSON");
        assert_eq!(value["ok"], true);
        assert_eq!(value["state"], "running");
        assert_eq!(value["guest_ready_us"], serde_json::Value::Null);
        let value: serde_json::Value = serde_json::from_str(&error("nope")).expect("JSON");
        assert_eq!((value["ok"].as_bool(), value["error"].as_str()), (Some(false), Some("nope")));
    }

    #[test]
    fn server_reads_lines_and_replies_in_order() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("ctl.sock");
        let mut server = ControlServer::bind(&path, 100).expect("binds");
        let mut client = UnixStream::connect(&path).expect("connects");
        let accepted = server.accept();
        assert_eq!(accepted.len(), 1);
        let token = accepted[0].0;
        client.write_all(b"{\"op\":\"status\"}\n{\"op\":\"pa").expect("sent");
        assert_eq!(server.read(token), Incoming::Lines(vec![Ok(Request::Status)]));
        client.write_all(b"use\"}\nnonsense\n").expect("sent");
        match server.read(token) {
            Incoming::Lines(lines) => {
                assert_eq!(lines.len(), 2);
                assert_eq!(lines[0], Ok(Request::Pause));
                assert!(lines[1].is_err());
            }
            Incoming::Closed => panic!("closed"),
        }
        server.reply(token, "{\"ok\":true}");
        let mut reader = BufReader::new(client.try_clone().expect("clone"));
        let mut line = String::new();
        reader.read_line(&mut line).expect("reply");
        assert_eq!(line, "{\"ok\":true}\n");
        drop(client);
        drop(reader);
        assert_eq!(server.read(token), Incoming::Closed);
        drop(server);
        assert!(!path.exists(), "the socket file is removed");
    }

    #[test]
    fn a_file_in_the_way_is_not_clobbered() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("ctl.sock");
        std::fs::write(&path, "precious").expect("written");
        assert!(matches!(ControlServer::bind(&path, 1), Err(ControlError::NotASocket(_))));
        assert_eq!(std::fs::read_to_string(&path).expect("kept"), "precious");
    }
}
