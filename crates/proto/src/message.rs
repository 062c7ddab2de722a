//! The typed messages carried in message frames.
//!
//! A connection carries exactly one operation:
//!
//! ```text
//! client                                   agent
//!   Hello{version} ───────────────────────▶
//!   Request{op…}   ───────────────────────▶   (pipelined: no wait for Welcome)
//!                  ◀─────────────────────── Welcome{version} | Error{version_mismatch}
//!   [Data(input)…, End]  ─────────────────▶   (exec stdin, write_file, tar_in)
//!                  ◀─────────────────────── Started / Reply / Data(output|error)… / End
//!                  ◀─────────────────────── Exited | Reply | Error
//! ```
//!
//! The egress proxy (protocol 1.1) adds a long-lived control connection:
//!
//! ```text
//! host                                     agent (proxy on 127.0.0.1:port)
//!   Request{egress_listen{port}} ─────────▶
//!                  ◀─────────────────────── Reply{listening}
//!                  ◀─────────────────────── EgressRequest{id, host, port}  (one per client)
//!   EgressDeny{id, reason} ───────────────▶   (the client gets HTTP 403)
//!   …or, on a new connection:
//!   Request{egress_attach{id}} ───────────▶
//!                  ◀─────────────────────── Reply{connected}, then raw bytes both ways
//! ```
//!
//! Messages are JSON so that a person can read a capture and so that unknown
//! fields from a newer minor version are ignored rather than fatal.

use serde::{Deserialize, Serialize};

use crate::error::WireError;

/// A protocol version. Peers of different `major` refuse each other; a
/// higher `minor` only adds optional fields and operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Version {
    pub major: u16,
    pub minor: u16,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The version this build speaks.
pub const PROTOCOL_VERSION: Version = Version { major: 1, minor: 2 };

/// Messages from the host (client) to the agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientMsg {
    /// First message of every connection.
    Hello { version: Version, client: String },
    /// The one operation of this connection.
    Request { request: Request },
    /// End of the input stream (stdin of a process, an upload).
    End,
    /// Send a signal to the process group of a running exec.
    Signal { signal: i32 },
    /// Resize the PTY of a running exec.
    Resize { size: WinSize },
    /// On an `egress_listen` connection: refuse the proxy client `id`; the
    /// agent answers it HTTP 403 with `reason` as the body.
    EgressDeny { id: u64, reason: String },
}

/// Messages from the agent to the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentMsg {
    /// The handshake succeeded.
    Welcome { version: Version, agent: String },
    /// The process of an exec started.
    Started { pid: u32 },
    /// The process of an exec ended; nothing follows.
    Exited { status: ExitStatus },
    /// The result of a non-exec operation.
    Reply { reply: Reply },
    /// The operation failed; nothing follows.
    Error { error: WireError },
    /// End of the output stream of a download.
    End,
    /// On an `egress_listen` connection: a proxy client asks to reach
    /// `host`:`port`; the host answers with `EgressDeny` or `egress_attach`.
    EgressRequest { id: u64, host: String, port: u16 },
}

/// One operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Exec(ExecRequest),
    ReadFile(ReadFileRequest),
    WriteFile(WriteFileRequest),
    Stat {
        path: String,
    },
    ListDir {
        path: String,
        /// 1 lists the directory's own entries; up to 5 descends further.
        depth: u8,
    },
    MakeDir {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<String>,
    },
    Move {
        from: String,
        to: String,
        #[serde(default)]
        overwrite: bool,
    },
    Remove {
        path: String,
        #[serde(default)]
        recursive: bool,
    },
    /// Stream a tar archive of the tree at `path` to the client.
    TarOut {
        path: String,
    },
    /// Unpack the tar archive the client streams into the directory `path`.
    TarIn {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<String>,
    },
    /// Connect to 127.0.0.1:`port` inside the sandbox; after the `Connected`
    /// reply the connection carries raw bytes both ways.
    PortForward {
        port: u16,
    },
    /// Agent version, uptime, kernel and load.
    Info,
    /// Run the egress proxy on 127.0.0.1:`port` inside the sandbox for as
    /// long as this connection stays open (protocol 1.1).
    EgressListen {
        port: u16,
    },
    /// Carry the tunnel of proxy client `id`: after the `Connected` reply the
    /// connection carries raw bytes both ways (protocol 1.1).
    EgressAttach {
        id: u64,
    },
    /// An operation this agent does not know (from a newer client).
    #[serde(other)]
    Unknown,
}

impl Request {
    /// The wire name of the operation, for logs and errors.
    pub fn op(&self) -> &'static str {
        match self {
            Self::Exec(_) => "exec",
            Self::ReadFile(_) => "read_file",
            Self::WriteFile(_) => "write_file",
            Self::Stat { .. } => "stat",
            Self::ListDir { .. } => "list_dir",
            Self::MakeDir { .. } => "make_dir",
            Self::Move { .. } => "move",
            Self::Remove { .. } => "remove",
            Self::TarOut { .. } => "tar_out",
            Self::TarIn { .. } => "tar_in",
            Self::PortForward { .. } => "port_forward",
            Self::Info => "info",
            Self::EgressListen { .. } => "egress_listen",
            Self::EgressAttach { .. } => "egress_attach",
            Self::Unknown => "unknown",
        }
    }
}

/// The operations this version knows, for "unknown operation" errors.
pub const OPERATIONS: &[&str] = &[
    "exec",
    "read_file",
    "write_file",
    "stat",
    "list_dir",
    "make_dir",
    "move",
    "remove",
    "tar_out",
    "tar_in",
    "port_forward",
    "info",
    "egress_listen",
    "egress_attach",
];

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// Executed directly, `argv[0]` looked up in `PATH`.
    Argv(Vec<String>),
    /// Run by `/bin/sh -c`.
    Shell(String),
}

/// Terminal size for a PTY.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WinSize {
    pub rows: u16,
    pub cols: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    pub command: Command,
    /// Added to (and overriding) the agent's base environment: `PATH`,
    /// `HOME`, `USER`, `LOGNAME`, `SHELL`, `LANG=C.UTF-8`, and `TERM` with a PTY.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<(String, String)>,
    /// Working directory; the user's home when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// User name or numeric uid; the agent's own user when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `true`: the client streams stdin and ends it with `End`; `false`:
    /// stdin is `/dev/null`.
    #[serde(default)]
    pub stdin: bool,
    /// Run on a pseudo-terminal of this size (stdout and stderr merge).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<WinSize>,
    /// Kill the whole process group after this many milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Send at most this many bytes of each of stdout and stderr; the agent
    /// reads the rest and drops it (the process is never held up by it)
    /// and counts it in [`ExitStatus::dropped_bytes`]. A flood of output
    /// then costs the sandbox's CPU, not the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_limit: Option<u64>,
    /// No command follows this one in the sandbox (a one-shot `moat run`;
    /// protocol 1.2, which an older agent ignores):
    /// the agent prepares nothing for a next one (on cgroup v1, the
    /// launcher a command's cgroup keeps for the next command). A command
    /// that comes anyway runs as a first command does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub last: bool,
}

impl ExecRequest {
    /// A request to run `argv` with everything else defaulted.
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::new(Command::Argv(argv.into_iter().map(Into::into).collect()))
    }

    /// A request to run `script` with `/bin/sh -c`.
    pub fn shell(script: impl Into<String>) -> Self {
        Self::new(Command::Shell(script.into()))
    }

    fn new(command: Command) -> Self {
        Self {
            command,
            env: Vec::new(),
            cwd: None,
            user: None,
            stdin: false,
            pty: None,
            timeout_ms: None,
            output_limit: None,
            last: false,
        }
    }
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// Exit code when the process exited normally.
    pub code: Option<i32>,
    /// Terminating signal when it was killed.
    pub signal: Option<i32>,
    /// The agent killed it because `timeout_ms` passed.
    pub timed_out: bool,
    /// Wall time from spawn to exit.
    pub duration_ms: u64,
    /// Output past the request's `output_limit`, read and dropped by the
    /// agent (both streams together).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropped_bytes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ExitStatus {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadFileRequest {
    pub path: String,
    #[serde(default)]
    pub offset: u64,
    /// Read at most this many bytes; to the end of the file when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteFileRequest {
    pub path: String,
    /// Permission bits; those of the replaced file (or 0644) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    /// Create missing parent directories.
    #[serde(default)]
    pub create_parents: bool,
    /// User name or uid to own the file; the replaced file's owner (or the
    /// agent's user) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// The most entries one listing carries: the agent cuts its walk there,
/// and the host keeps no more of a reply, whatever a guest sends.
pub const MAX_LIST_ENTRIES: usize = 10_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// The last path component (lossily converted when not UTF-8).
    pub name: String,
    /// The full path (lossily converted when not UTF-8).
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: i64,
    /// Where a symlink points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
    /// The name was not valid UTF-8 and `name`/`path` are lossy.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lossy_name: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub agent_version: String,
    pub protocol: Version,
    /// Seconds since the (guest) kernel booted.
    pub uptime_secs: f64,
    /// Seconds since the agent started.
    pub agent_uptime_secs: f64,
    /// `uname -srm`.
    pub kernel: String,
    pub hostname: String,
    /// 1, 5 and 15 minute load averages.
    pub load: [f64; 3],
    /// The agent runs as PID 1 (init of a microVM or jail).
    pub init: bool,
    /// Processes in the sandbox besides the agent itself (kernel threads
    /// not counted): commands and servers still running. 0 from agents
    /// older than this field.
    #[serde(default)]
    pub processes: u32,
}

/// Results of non-exec operations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reply {
    /// `length` bytes of the file follow as output data, then `End`.
    FileData {
        size: u64,
        length: u64,
    },
    Written {
        bytes: u64,
    },
    Stat {
        info: FileInfo,
    },
    Entries {
        entries: Vec<FileInfo>,
        truncated: bool,
    },
    Done,
    /// A tar archive follows as output data, then `End`.
    TarStream,
    Unpacked {
        entries: u64,
        bytes: u64,
    },
    Connected,
    Info {
        info: AgentInfo,
    },
    /// The egress proxy listens; requests follow as `EgressRequest`.
    Listening {
        port: u16,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_operation_decodes_as_unknown() {
        let msg: ClientMsg =
            serde_json::from_str(r#"{"type":"request","request":{"op":"teleport","to":"mars"}}"#).expect("decodes");
        assert_eq!(msg, ClientMsg::Request { request: Request::Unknown });
    }

    #[test]
    fn operations_list_matches_the_enum() {
        let requests = [
            Request::Exec(ExecRequest::shell("true")),
            Request::ReadFile(ReadFileRequest { path: "/".into(), offset: 0, length: None }),
            Request::WriteFile(WriteFileRequest { path: "/".into(), mode: None, create_parents: false, owner: None }),
            Request::Stat { path: "/".into() },
            Request::ListDir { path: "/".into(), depth: 1 },
            Request::MakeDir { path: "/".into(), owner: None },
            Request::Move { from: "/a".into(), to: "/b".into(), overwrite: false },
            Request::Remove { path: "/".into(), recursive: false },
            Request::TarOut { path: "/".into() },
            Request::TarIn { path: "/".into(), owner: None },
            Request::PortForward { port: 1 },
            Request::Info,
            Request::EgressListen { port: 3128 },
            Request::EgressAttach { id: 7 },
        ];
        let ops: Vec<_> = requests.iter().map(Request::op).collect();
        assert_eq!(ops, OPERATIONS);
        for request in requests {
            let json = serde_json::to_string(&request).expect("encodes");
            assert!(json.contains(&format!("\"op\":\"{}\"", request.op())), "{json}");
            let back: Request = serde_json::from_str(&json).expect("decodes");
            assert_eq!(back, request);
        }
    }

    #[test]
    fn a_last_command_is_said_only_when_it_is() {
        let mut request = ExecRequest::argv(["true"]);
        let plain = serde_json::to_string(&request).expect("encodes");
        assert!(!plain.contains("last"), "{plain}");
        request.last = true;
        let last = serde_json::to_string(&request).expect("encodes");
        assert!(last.contains("\"last\":true"), "{last}");
        assert_eq!(serde_json::from_str::<ExecRequest>(&last).expect("decodes"), request);
        let older: ExecRequest = serde_json::from_str(&plain).expect("decodes");
        assert!(!older.last, "absent means more may follow");
    }

    #[test]
    fn newer_minor_fields_are_ignored() {
        let msg: ClientMsg = serde_json::from_str(
            r#"{"type":"hello","version":{"major":1,"minor":9},"client":"x","compression":"zstd"}"#,
        )
        .expect("decodes");
        assert!(matches!(msg, ClientMsg::Hello { version: Version { major: 1, minor: 9 }, .. }));
    }
}
