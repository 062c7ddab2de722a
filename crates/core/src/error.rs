//! The errors of `moat-core`, one enum per operation: each says what went
//! wrong in core's words (no MCP tool is named; moat-mcp adds that advice)
//! and what to do. [`CoreError`] holds any of them, for callers that handle
//! every operation's errors alike.

use crate::grants::{GrantsError, NotGranted};
use crate::image::ImageError;
use crate::sandbox::InvalidSpec;

/// The error of reading moat's configuration and opening a
/// [`Moat`](crate::Moat): [`MoatConfig::from_env`](crate::MoatConfig::from_env),
/// [`Moat::new`](crate::Moat::new), and the settings they read
/// (`MOAT_ROOTS`, `MOAT_COPY_MAX_MIB`, `MOAT_MAX_MEMORY_MIB`).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The operator's configuration is wrong; the binaries exit with 2.
    #[error("Configuration: {0}")]
    Invalid(String),
    /// The pool's spec asks for more than the operator grants.
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
}

/// The error of creating a sandbox: [`Moat::create`](crate::Moat::create),
/// the pool, and the backends' `start`.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("Invalid sandbox spec: {0}")]
    InvalidSpec(String),
    /// The spec asks for more than the operator grants.
    #[error(transparent)]
    NotGranted(#[from] NotGranted),
    #[error(
        "The limit of {max} live sandboxes is reached; destroy one first. Only the operator who starts moat can \
         allow more (moat-mcp: MOAT_MAX_SANDBOXES)"
    )]
    LimitReached { max: usize },
    /// The live sandboxes' `memory_mib` would pass `MOAT_MAX_MEMORY_MIB`.
    #[error("The host's memory for sandboxes is taken: {0}")]
    HostMemory(String),
    #[error("The host's disk for sandboxes is taken: {0}")]
    HostDisk(String),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("Sandbox {id} failed to start: {reason}")]
    StartFailed { id: String, reason: String },
    #[error(transparent)]
    Io(#[from] IoError),
    /// Starting the new sandbox's egress proxy through its agent failed.
    #[error("Sandbox {id}: the agent failed")]
    Agent {
        id: String,
        #[source]
        source: moat_proto::ProtoError,
    },
}

impl From<InvalidSpec> for CreateError {
    fn from(e: InvalidSpec) -> Self {
        Self::InvalidSpec(e.0)
    }
}

/// The error of an operation on a live sandbox: running processes and code
/// in it ([`Moat::exec`](crate::Moat::exec), `run`, `exec_streaming`,
/// `run_code`), reaching its agent (`client`, `with_agent`), looking it up,
/// suspending, destroying it, and its preview links.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("No sandbox {id:?}; live sandboxes: {}", if known.is_empty() { "none".to_owned() } else { known.join(", ") })]
    UnknownSandbox { id: String, known: Vec<String> },
    #[error("Sandbox {0} expired (its timeout_seconds passed) and was destroyed; create a new one")]
    Expired(String),
    /// The sandbox ended on its own (its agent, jail or microVM died); it
    /// is listed as `failed` and its resources are released.
    #[error(
        "Sandbox {id} failed: {reason}. Its processes and files are gone and its resources were released; \
         create another sandbox (destroying this one removes it from the list)"
    )]
    Failed { id: String, reason: String },
    #[error(
        "Sandbox {id} did not answer for {waited_s} s (a command gets {} s past its own timeout, any other call \
         {} s): its agent or kernel is stuck. Destroy it and create another",
        crate::timing::ANSWER_GRACE.as_secs(),
        crate::moat::AGENT_CALL_GUARD.as_secs()
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
    /// A preview link was asked for port 0.
    #[error("Invalid sandbox spec: port must be from 1 to 65535")]
    InvalidPort,
    /// Sandbox `id` has [`crate::net::preview::MAX_LINKS`] preview
    /// listeners already.
    #[error(
        "Sandbox {id} has preview links for {max} ports already, the most one sandbox may have (each lasts until \
         the sandbox ends): ask again for one of its ports ({ports}) for a new URL, serve more pages behind one \
         port, or use another sandbox"
    )]
    TooManyPreviews { id: String, max: usize, ports: String },
    #[error(transparent)]
    Io(#[from] IoError),
}

/// A host path a call named was refused, or a copy on the host failed; what
/// [`crate::hostfs`] returns.
#[derive(Debug, thiserror::Error)]
#[error("Host path refused: {0}")]
pub struct HostPathError(pub String);

/// The error of copying between the host and a sandbox:
/// [`Moat::copy_to_sandbox`](crate::Moat::copy_to_sandbox) and
/// [`Moat::copy_from_sandbox`](crate::Moat::copy_from_sandbox).
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error(transparent)]
    HostPath(#[from] HostPathError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
}

/// The error of a task: [`Moat::task_start`](crate::Moat::task_start),
/// `task_diff`, `task_finish`, `remove_task`.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("No task {id:?} (a task ends with its sandbox: finished, destroyed, expired or failed); tasks in progress: {}", if known.is_empty() { "none".to_owned() } else { known.join(", ") })]
    UnknownTask { id: String, known: Vec<String> },
    #[error("Cannot import the project: {0}")]
    ImportRefused(String),
    /// The path to import is a file.
    #[error("Host path refused: {} is not a directory; give a project directory", .0.display())]
    NotADirectory(std::path::PathBuf),
    /// The baseline commit or the diff failed in the task's sandbox.
    #[error("Git in sandbox {id}: {reason}")]
    Git { id: String, reason: String },
    /// Writing or removing a task record failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The retained records would hold more than the operator allows.
    #[error("No room for the task's record: {0}")]
    RecordsFull(String),
    #[error(transparent)]
    Create(#[from] CreateError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Copy(#[from] CopyError),
}

/// An I/O error of moat's own on the host while doing `what` for sandbox
/// (or task) `id`.
#[derive(Debug, thiserror::Error)]
#[error("Sandbox {id}: {what}{}", full_disk_hint(source))]
pub struct IoError {
    pub id: String,
    pub what: String,
    #[source]
    pub source: std::io::Error,
}

/// Any of core's errors, for callers that handle every operation alike
/// (moat-mcp's tool errors, the CLI). It holds the enum of the operation
/// that went wrong: an error that a task or a copy passed on from a sandbox
/// or a create is held as that sandbox's or create's error, never nested.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Create(#[from] CreateError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    HostPath(#[from] HostPathError),
    #[error(transparent)]
    Task(TaskError),
}

impl From<CopyError> for CoreError {
    fn from(e: CopyError) -> Self {
        match e {
            CopyError::HostPath(e) => Self::HostPath(e),
            CopyError::Sandbox(e) => Self::Sandbox(e),
        }
    }
}

impl From<TaskError> for CoreError {
    fn from(e: TaskError) -> Self {
        match e {
            TaskError::Create(e) => Self::Create(e),
            TaskError::Sandbox(e) => Self::Sandbox(e),
            TaskError::Copy(e) => e.into(),
            task => Self::Task(task),
        }
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

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    fn unresponsive() -> SandboxError {
        SandboxError::Unresponsive { id: "sbx-1".into(), waited_s: 35 }
    }

    #[test]
    fn a_sandbox_error_that_a_task_or_a_copy_passes_on_is_held_as_a_sandbox_error() {
        let from_task = CoreError::from(TaskError::Sandbox(unresponsive()));
        assert!(matches!(from_task, CoreError::Sandbox(SandboxError::Unresponsive { .. })), "{from_task:?}");
        let from_copy = CoreError::from(CopyError::Sandbox(unresponsive()));
        assert!(matches!(from_copy, CoreError::Sandbox(SandboxError::Unresponsive { .. })), "{from_copy:?}");
        let from_task_copy = CoreError::from(TaskError::Copy(CopyError::Sandbox(unresponsive())));
        assert!(matches!(from_task_copy, CoreError::Sandbox(_)), "{from_task_copy:?}");
        let refused = CoreError::from(TaskError::Copy(CopyError::HostPath(HostPathError("x".into()))));
        assert!(matches!(refused, CoreError::HostPath(_)), "{refused:?}");
    }

    #[test]
    fn a_wrapped_error_keeps_its_text_and_its_cause() {
        let io = || IoError {
            id: "task-1".into(),
            what: "writing the patch".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        let core = CoreError::from(TaskError::Io(io()));
        assert_eq!(core.to_string(), io().to_string());
        assert!(core.to_string().contains("the disk holding moat's data directory is full"), "{core}");
        let cause = core.source().map(ToString::to_string);
        assert_eq!(cause, Some(std::io::Error::from_raw_os_error(libc::ENOSPC).to_string()));
    }
}
