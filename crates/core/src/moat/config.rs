//! How a [`Moat`](super::Moat) runs: its configuration, the backend it picks, and where
//! the agent binary is.

use std::path::{Path, PathBuf};

use crate::backend::jail::JailBackend;
use crate::backend::machine::{Runner, find_vmm};
use crate::backend::vm::VmBackend;
use crate::backend::{BackendKind, HostVirtualization};
use crate::error::ConfigError;
use crate::grants::Grants;
use crate::hostfs;
use crate::image;
use crate::net::egress::EgressConfig;
use crate::net::preview::PreviewHost;
use crate::sandbox::SandboxSpec;
use crate::trust::ExtraCa;

/// How a [`Moat`](super::Moat) runs.
#[derive(Debug, Clone)]
pub struct MoatConfig {
    pub data_dir: PathBuf,
    pub backend: BackendKind,
    /// The `moat-agent` binary (static) that jails run.
    pub agent: PathBuf,
    pub max_sandboxes: usize,
    /// Host directories the copy and task tools may read and write (see
    /// [`hostfs::roots_from_env`]); empty shares none.
    pub roots: Vec<PathBuf>,
    /// The most one copy or import may move, in bytes (`MOAT_COPY_MAX_MIB`).
    pub copy_limit: u64,
    /// The most the retained task records may hold in all, in bytes
    /// (`MOAT_TASK_RECORDS_MIB`).
    pub task_records_limit: u64,
    /// Sandboxes kept started ahead of need, for `create` calls whose spec
    /// equals `pool_spec`: those return at once. 0 turns the pool off.
    pub pool_size: usize,
    pub pool_spec: SandboxSpec,
    /// What `filtered` sandboxes may reach beyond their runtime's registries
    /// (and a task's repository host).
    pub egress: EgressConfig,
    /// The most a spec may ask for ([`Grants::check`]): `MOAT_ALLOW_NETWORK`,
    /// and for `allow_hosts`, the hosts of `egress` and the registries.
    pub grants: Grants,
    /// CA certificates every new sandbox trusts beyond its image's
    /// (`MOAT_CA_FILE`; [`crate::trust`]).
    pub extra_ca: Option<ExtraCa>,
    /// Where preview links listen and the host their URLs name: the
    /// loopback, unless moat-mcp serves remote clients over HTTP.
    pub preview: PreviewHost,
    /// The most the live sandboxes' memory may add up to, in MiB
    /// ([`crate::limits`]); `None`: `MOAT_MAX_MEMORY_MIB`, read when the
    /// `Moat` starts, or its default share of the host.
    pub max_memory_mib: Option<u64>,
}

impl MoatConfig {
    /// The data directory from the environment, backend `auto`, the agent
    /// from `$MOAT_AGENT` or beside the running executable, 16 sandboxes,
    /// and the grants of `MOAT_ALLOW_NETWORK` (none unless set).
    pub fn from_env() -> Result<Self, ConfigError> {
        Ok(Self { grants: Grants::from_env()?, ..Self::operator_from_env()? })
    }

    /// [`MoatConfig::from_env`] for the operator's own tools (the `moat`
    /// CLI): everything is granted, and `MOAT_ALLOW_NETWORK` is not read.
    pub fn operator_from_env() -> Result<Self, ConfigError> {
        // The operator's errors (exit 2) before the machine's.
        let roots = hostfs::roots_from_env()?;
        let copy_limit = hostfs::copy_limit_from_env()?;
        let task_records_limit = crate::task::records_limit_from_env()?;
        let extra_ca = ExtraCa::from_env()?;
        Ok(Self {
            data_dir: image::data_dir(),
            backend: BackendKind::Auto,
            agent: find_agent()?,
            max_sandboxes: 16,
            roots,
            copy_limit,
            task_records_limit,
            pool_size: 0,
            pool_spec: SandboxSpec::default(),
            egress: EgressConfig::from_env(),
            grants: Grants::everything(),
            extra_ca,
            preview: PreviewHost::default(),
            max_memory_mib: None,
        })
    }
}

/// The backend `config.backend` resolves to on this host: `auto` is a
/// microVM where the host has hardware virtualization and `moat-vmm` is
/// found, a jail otherwise (see [`HostVirtualization::choose`]).
pub(super) fn choose_backend(config: &MoatConfig) -> Result<Runner, ConfigError> {
    let choice = HostVirtualization::resolve(config.backend);
    match choice.kind {
        BackendKind::Vm => match find_vmm() {
            Some(vmm) => Ok(Runner::Vm(VmBackend::new(vmm))),
            None if config.backend == BackendKind::Vm => Err(ConfigError::VmmMissing),
            None => {
                tracing::info!("{}, but moat-vmm is not found: using jails", choice.reason);
                Ok(Runner::Jail(JailBackend::new(config.agent.clone())))
            }
        },
        _ => Ok(Runner::Jail(JailBackend::new(config.agent.clone()))),
    }
}

/// Where the agent binary is: `$MOAT_AGENT`, else the static build
/// (`target/x86_64-unknown-linux-gnu/release/moat-agent`, as `cargo xtask
/// build` makes it) near the current executable, else the package's
/// (`PREFIX/lib/moat/moat-agent` for `PREFIX/bin/moat`), else `moat-agent`
/// beside it.
pub fn find_agent() -> Result<PathBuf, ConfigError> {
    if let Some(path) = std::env::var_os("MOAT_AGENT") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(ConfigError::AgentMissing(format!("MOAT_AGENT={}", path.display())))
        };
    }
    let exe = std::env::current_exe().map_err(|e| ConfigError::AgentMissing(e.to_string()))?;
    let dirs: Vec<&Path> = exe.ancestors().skip(1).take(3).collect();
    let static_builds = dirs.iter().map(|d| d.join("x86_64-unknown-linux-gnu/release/moat-agent"));
    // Installed from the Debian package: `/usr/bin/moat`, `/usr/lib/moat/moat-agent`.
    let installed = dirs.get(1).map(|prefix| prefix.join("lib/moat/moat-agent"));
    let candidates: Vec<PathBuf> =
        static_builds.chain(installed).chain(dirs.iter().take(2).map(|d| d.join("moat-agent"))).collect();
    candidates.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        ConfigError::AgentMissing(format!(
            "looked at {}",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ))
    })
}
