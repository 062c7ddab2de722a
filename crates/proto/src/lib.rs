//! The host ↔ agent wire protocol of moat.
//!
//! Every operation (run a process, read a file, stream a tar…) uses its own
//! connection — a Unix socket to a jail's agent or a vsock stream to a
//! microVM's — opened with a versioned handshake. On the connection travel
//! length-prefixed [frames](frame): JSON [messages](message) with a typed
//! header, and raw data chunks for bulk bytes (stdout, file contents, tar).
//!
//! This crate holds no I/O policy and no sandbox model: [`AgentClient`] works
//! over anything that is `AsyncRead + AsyncWrite`, through a [`Connector`].

pub mod client;
pub mod conn;
pub mod error;
pub mod frame;
pub mod message;

pub use client::{
    AgentClient, AgentStream, Connector, EgressControl, EgressRequest, ExecHandle, ExecStdin, InUse, Output,
    UnixConnector, served_by,
};
pub use conn::{Connection, Prefixed};
pub use error::{ErrorKind, ProtoError, WireError};
pub use frame::{DATA_CHUNK, Frame, FrameCodec, FrameError, MAX_DATA_FRAME_LEN, MAX_FRAME_LEN, StreamId};
pub use message::{
    AgentInfo, AgentMsg, ClientMsg, Command, ExecRequest, ExitStatus, FileInfo, FileKind, MAX_LIST_ENTRIES, OPERATIONS,
    PROTOCOL_VERSION, ReadFileRequest, Reply, Request, Version, WinSize, WriteFileRequest,
};
