//! Errors: the typed error the agent sends, and the client's error.

use serde::{Deserialize, Serialize};

use crate::frame::FrameError;
use crate::message::Version;

/// What kind of failure an agent reports; clients branch on this, people
/// read the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    #[error("not found")]
    NotFound,
    #[error("is a directory")]
    IsADirectory,
    #[error("not a directory")]
    NotADirectory,
    #[error("directory not empty")]
    DirectoryNotEmpty,
    #[error("permission denied")]
    PermissionDenied,
    #[error("already exists")]
    AlreadyExists,
    #[error("too large")]
    TooLarge,
    #[error("no space left")]
    NoSpace,
    #[error("invalid path")]
    InvalidPath,
    #[error("invalid request")]
    InvalidRequest,
    #[error("unknown operation")]
    UnknownOperation,
    #[error("protocol version mismatch")]
    VersionMismatch,
    #[error("malformed message")]
    Malformed,
    #[error("connection refused")]
    ConnectionRefused,
    #[error("busy")]
    Busy,
    #[error("I/O error")]
    Io,
    #[error("internal error")]
    Internal,
    /// A kind from a newer agent.
    #[serde(other)]
    #[error("other error")]
    Other,
}

/// An error as it travels on the wire: a kind to branch on and a message
/// that says what was wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct WireError {
    pub kind: ErrorKind,
    pub message: String,
}

impl WireError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }
}

/// Everything that can go wrong talking to an agent.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("Could not connect to the agent")]
    Connect(#[source] std::io::Error),
    #[error("Agent connection failed")]
    Frame(#[from] FrameError),
    #[error("The agent refused the operation ({kind}): {0}", kind = .0.kind)]
    Agent(WireError),
    #[error(
        "The agent speaks protocol {agent}, this client {client}; rebuild the image (`cargo xtask image --force`) or the host binaries so they match"
    )]
    VersionMismatch { agent: Version, client: Version },
    #[error("The agent sent a message this client cannot decode: {0}")]
    Malformed(String),
    #[error("Unexpected message from the agent: expected {expected}, got {got}")]
    Unexpected { expected: &'static str, got: String },
    #[error("The agent closed the connection {0}")]
    Closed(&'static str),
    #[error("I/O error while streaming data to or from the agent")]
    Io(#[from] std::io::Error),
}

impl ProtoError {
    /// The agent's error kind, when the agent refused the operation.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            Self::Agent(e) => Some(e.kind),
            _ => None,
        }
    }

    /// Whether the connection to the agent was lost or never made (as when
    /// the sandbox died), rather than an answer the agent gave.
    pub fn is_lost_connection(&self) -> bool {
        matches!(self, Self::Connect(_) | Self::Frame(_) | Self::Closed(_) | Self::Io(_))
    }
}
