//! moat's sandbox and task model, and its isolation backends.
//!
//! [`Moat`] is the entry point: it creates sandboxes from a [`SandboxSpec`],
//! runs processes and moves files through each sandbox's agent, suspends
//! idle sandboxes, destroys expired ones, and — when a previous owner was
//! killed — sweeps what it left behind. Sandboxes run as microVMs under
//! moat-vmm ([`backend::vm`]) or in namespace jails ([`backend::jail`]), one type
//! over both in [`backend::machine`]. Images are found and checked by [`image`], the backend for
//! a host is chosen by [`backend`].

pub mod backend;
pub mod capped_log;
pub mod cgroup;
pub mod dynmods;
pub mod error;
pub mod grants;
pub mod hostfs;
pub mod hostuser;
pub mod image;
pub mod interpreter;
pub mod limits;
pub mod log;
pub mod moat;
pub mod net;
pub mod process;
pub mod programs;
pub mod runtime;
pub mod sandbox;
pub mod state;
pub mod task;
pub mod timing;
pub mod trust;

pub use backend::{Backend, BackendChoice, BackendKind, HostVirtualization, Instance};
pub use error::{ConfigError, CopyError, CoreError, CreateError, HostPathError, IoError, SandboxError, TaskError};
pub use grants::Grants;
pub use image::{Image, ImageError, Manifest};
pub use interpreter::{CodeError, CodeOutput, Language, StreamName};
pub use moat::{ExecOutcome, Moat, MoatConfig, StreamedCommand};
pub use net::egress::{EgressConfig, EgressDecision, IpNet};
pub use net::preview::PreviewLink;
pub use runtime::Runtime;
pub use sandbox::{NetworkPolicy, Sandbox, SandboxSpec, SandboxState};
pub use task::{DiffSummary, Task, TaskRecord};
