//! The backend a [`Moat`](crate::Moat) runs, chosen once at start, and its
//! sandboxes: one type over both backends, so the rest of core is written
//! once.

use std::path::{Path, PathBuf};

use moat_proto::{AgentClient, UnixConnector};

use crate::backend::jail::{Jail, JailBackend};
use crate::backend::vm::{Vm, VmBackend};
use crate::backend::{Backend, BackendKind, Instance};
use crate::error::CreateError;
use crate::image::Image;
use crate::sandbox::SandboxSpec;

/// The backend in use.
#[derive(Debug, Clone)]
pub enum Runner {
    Jail(JailBackend),
    Vm(VmBackend),
}

/// A running sandbox of either backend. Dropping it destroys the sandbox.
#[derive(Debug)]
pub enum Machine {
    Jail(Jail),
    Vm(Vm),
}

impl Runner {
    pub fn kind(&self) -> BackendKind {
        match self {
            Self::Jail(backend) => backend.kind(),
            Self::Vm(backend) => backend.kind(),
        }
    }

    pub async fn start(
        &self,
        id: &str,
        hostname: &str,
        spec: &SandboxSpec,
        image: &Image,
        data_dir: &Path,
    ) -> Result<Machine, CreateError> {
        match self {
            Self::Jail(backend) => backend.start(id, hostname, spec, image, data_dir).await.map(Machine::Jail),
            Self::Vm(backend) => backend.start(id, hostname, spec, image, data_dir).await.map(Machine::Vm),
        }
    }
}

impl Machine {
    fn instance(&self) -> &dyn Instance {
        match self {
            Self::Jail(jail) => jail,
            Self::Vm(vm) => vm,
        }
    }

    fn instance_mut(&mut self) -> &mut dyn Instance {
        match self {
            Self::Jail(jail) => jail,
            Self::Vm(vm) => vm,
        }
    }

    pub fn client(&self) -> AgentClient<UnixConnector> {
        self.instance().client()
    }

    pub fn host_pid(&self) -> u32 {
        self.instance().host_pid()
    }

    pub fn exit_watch(&self) -> std::io::Result<crate::process::Pidfd> {
        self.instance().exit_watch()
    }

    pub fn ended(&mut self) -> Option<String> {
        self.instance_mut().ended()
    }

    pub fn power_switch(&self) -> Option<crate::backend::PowerSwitch> {
        self.instance().power_switch()
    }
}

/// Where `moat-vmm` is: `$MOAT_VMM`, else beside the current executable
/// (`cargo xtask build` puts both in `target/release`), else on `PATH`.
pub fn find_vmm() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("MOAT_VMM") {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    let beside = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join("moat-vmm")));
    beside.filter(|p| p.is_file()).or_else(|| crate::programs::find_program("moat-vmm"))
}
