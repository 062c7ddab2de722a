//! The errors of `moat-core`: each says what was wrong and what to do.

use crate::grants::{GrantsError, NotGranted};
use crate::image::ImageError;
use crate::sandbox::InvalidSpec;

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("Invalid sandbox spec: {0}")]
    InvalidSpec(String),
    #[error("No sandbox {id:?}; live sandboxes: {}", if known.is_empty() { "none".to_owned() } else { known.join(", ") })]
    UnknownSandbox { id: String, known: Vec<String> },
    #[error("Sandbox {0} expired (its timeout_seconds passed) and was destroyed; create a new one")]
    Expired(String),
    #[error("The limit of {max} live sandboxes is reached; destroy one first (or raise max_sandboxes)")]
    LimitReached { max: usize },
    /// The live sandboxes' `memory_mib` would pass `MOAT_MAX_MEMORY_MIB`.
    #[error("The host's memory for sandboxes is taken: {0}")]
    HostMemory(String),
    #[error("No task {id:?}; tasks: {}", if known.is_empty() { "none".to_owned() } else { known.join(", ") })]
    UnknownTask { id: String, known: Vec<String> },
    #[error("Cannot import the project: {0}")]
    ImportRefused(String),
    /// A host path a tool call named was refused, or a copy failed.
    #[error("Host path refused: {0}")]
    HostPath(String),
    /// The operator's configuration is wrong; the binaries exit with 2.
    #[error("Configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A spec asks for more than the operator grants.
    #[error(transparent)]
    NotGranted(#[from] NotGranted),
    #[error(transparent)]
    Grants(#[from] GrantsError),
    #[error(
        "The vm backend needs moat-vmm: build it with `cargo xtask build`, put it beside this program or on PATH, \
         or set MOAT_VMM (or use MOAT_BACKEND=jail)"
    )]
    VmmMissing,
    #[error("Cannot find the moat-agent binary ({0}); build it with `cargo xtask build` or set MOAT_AGENT")]
    AgentMissing(String),
    /// The sandbox ended on its own (its agent, jail or microVM died); it
    /// is listed as `failed` and its resources are released.
    #[error(
        "Sandbox {id} failed: {reason}. Its processes and files are gone and its resources were released; \
         create another sandbox (destroying this one removes it from the list)"
    )]
    Failed { id: String, reason: String },
    #[error("Sandbox {id} failed to start: {reason}")]
    StartFailed { id: String, reason: String },
    #[error("Sandbox {id}: {what}{}", full_disk_hint(source))]
    Io {
        id: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "Sandbox {id} did not answer for {waited_s} s, {} s past its command's timeout: its agent or kernel is \
         stuck. Destroy it and create another",
        crate::timing::ANSWER_GRACE.as_secs()
    )]
    Unresponsive { id: String, waited_s: u64 },
    /// Python's session for `run_code` could not start or be reached.
    #[error("Sandbox {id}: {reason}")]
    CodeSession { id: String, reason: String },
    #[error("Sandbox {id}: the agent failed")]
    Agent {
        id: String,
        #[source]
        source: moat_proto::ProtoError,
    },
}

impl From<InvalidSpec> for CoreError {
    fn from(e: InvalidSpec) -> Self {
        Self::InvalidSpec(e.0)
    }
}

/// Words for an I/O error that a full disk caused: what moat writes on
/// its own (sandbox state, task records) lives in its data directory.
fn full_disk_hint(source: &std::io::Error) -> &'static str {
    match source.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT) => {
            " (the disk holding moat's data directory is full: free space there, e.g. remove old task records, \
             and try again; what moat saved before is unchanged)"
        }
        _ => "",
    }
}
