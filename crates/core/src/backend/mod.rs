//! Isolation backends: the [`Backend`] trait every backend implements, and
//! which backend a sandbox gets on this host, and why.

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::str::FromStr;

use moat_proto::{AgentClient, UnixConnector};

use crate::error::{CreateError, IoError};
use crate::image::Image;
use crate::sandbox::SandboxSpec;

pub mod ids;
pub mod jail;
pub mod machine;
pub mod passt;
pub mod rootdisk;
pub mod vm;

/// Something that starts sandboxes: the jail backend (`crate::backend::jail`) and
/// the microVM backend (`crate::backend::vm`).
pub trait Backend: Send + Sync + 'static {
    type Instance: Instance;

    fn kind(&self) -> BackendKind;

    /// Starts sandbox `id` from `image` and returns once its agent answers.
    /// Its state lives in `<data_dir>/sandboxes/<id>/`.
    fn start(
        &self,
        id: &str,
        hostname: &str,
        spec: &SandboxSpec,
        image: &Image,
        data_dir: &Path,
    ) -> impl Future<Output = Result<Self::Instance, CreateError>> + Send;
}

/// Suspends (`true`) or resumes (`false`) one sandbox, apart from the
/// value that owns it: a switch is flipped with no lock of moat's held, on
/// a blocking thread, because a microVM's answer comes from its VMM (within
/// a bound of seconds) and only that sandbox's callers may wait for it.
/// Flipped once the sandbox is gone, it fails harmlessly: its cgroups or
/// its VMM's control socket are no longer there.
pub type PowerSwitch = std::sync::Arc<dyn Fn(bool) -> Result<(), IoError> + Send + Sync>;

/// One running sandbox of a backend. Dropping it destroys the sandbox.
pub trait Instance: Send + 'static {
    /// A client of the sandbox's agent.
    fn client(&self) -> AgentClient<UnixConnector>;
    /// What suspends and resumes the sandbox (freezes its cgroups, or
    /// pauses its vCPUs), or `None` where it cannot be suspended.
    fn power_switch(&self) -> Option<PowerSwitch>;
    /// Stops every process of the sandbox and removes its state.
    fn destroy(&mut self);
    /// The host process the sandbox lives in (the jail's monitor, or
    /// moat-vmm): when it ends, the sandbox has ended.
    fn host_pid(&self) -> u32;
    /// A descriptor of [`Instance::host_pid`] that becomes readable when
    /// it ends, to wait on.
    fn exit_watch(&self) -> std::io::Result<crate::process::Pidfd>;
    /// How the sandbox ended, in words, once its host process has ended
    /// without being asked to (`None` while it runs).
    fn ended(&mut self) -> Option<String>;
}

/// An isolation backend, or `auto` to let the host decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Auto,
    /// A KVM microVM under `moat-vmm`.
    Vm,
    /// Linux namespaces, seccomp and cgroups.
    Jail,
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "vm" => Ok(Self::Vm),
            "jail" => Ok(Self::Jail),
            _ => Err(format!("unknown backend {s:?}; allowed are auto, vm, jail")),
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Vm => "vm",
            Self::Jail => "jail",
        })
    }
}

/// What the host offers for running microVMs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostVirtualization {
    /// `/dev/kvm` exists and opens read-write.
    pub kvm_usable: bool,
    /// Why `/dev/kvm` is not usable, when it is not.
    pub kvm_problem: Option<String>,
    /// The CPU flag for hardware virtualization (`vmx` or `svm`), if shown.
    pub cpu_flag: Option<&'static str>,
}

impl HostVirtualization {
    /// Looks at `/dev/kvm` and `/proc/cpuinfo`.
    pub fn probe() -> Self {
        Self::probe_at(Path::new("/dev/kvm"), Path::new("/proc/cpuinfo"))
    }

    fn probe_at(kvm: &Path, cpuinfo: &Path) -> Self {
        let kvm_problem = match std::fs::OpenOptions::new().read(true).write(true).open(kvm) {
            Ok(_) => None,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                let name = crate::hostuser::HostUser::current().display_name();
                Some(format!(
                    "{}: {e}; microVMs need it read-write: as root, run `usermod -aG kvm {name}` (then log in \
                     again), or pick the jail backend",
                    kvm.display()
                ))
            }
            Err(e) => Some(format!("{}: {e}", kvm.display())),
        };
        let cpu_flag = cpu_virt_flag(&std::fs::read_to_string(cpuinfo).unwrap_or_default());
        Self { kvm_usable: kvm_problem.is_none(), kvm_problem, cpu_flag }
    }

    /// `vm` needs both a usable `/dev/kvm` and hardware virtualization: a
    /// paravirtual KVM without `vmx`/`svm` cannot boot a stock Linux kernel.
    pub fn supports_vm(&self) -> bool {
        self.kvm_usable && self.cpu_flag.is_some()
    }

    /// The backend `requested` resolves to, probing this host only when
    /// the choice depends on it (`auto`): a sandbox's whole life in
    /// `moat run --backend jail` need not open /dev/kvm or read cpuinfo.
    pub fn resolve(requested: BackendKind) -> BackendChoice {
        match requested {
            BackendKind::Auto => Self::probe().choose(requested),
            explicit => Self { kvm_usable: false, kvm_problem: None, cpu_flag: None }.choose(explicit),
        }
    }

    /// The backend `requested` resolves to on this host, with the reason.
    pub fn choose(&self, requested: BackendKind) -> BackendChoice {
        let (kind, reason) = match requested {
            BackendKind::Vm => (BackendKind::Vm, "requested explicitly".to_owned()),
            BackendKind::Jail => (BackendKind::Jail, "requested explicitly".to_owned()),
            BackendKind::Auto if self.supports_vm() => (
                BackendKind::Vm,
                format!("/dev/kvm works and the CPU shows {}", self.cpu_flag.unwrap_or("hardware virtualization")),
            ),
            BackendKind::Auto => (BackendKind::Jail, format!("no microVMs here: {}", self.vm_missing())),
        };
        BackendChoice { kind, reason }
    }

    /// What this host lacks for microVMs, in words.
    pub fn vm_missing(&self) -> String {
        let mut missing = Vec::new();
        if let Some(problem) = &self.kvm_problem {
            missing.push(format!("/dev/kvm is not usable ({problem})"));
        }
        if self.cpu_flag.is_none() {
            missing.push(
                "the CPU shows no vmx/svm flag (no hardware virtualization, e.g. a paravirtual nested KVM)".into(),
            );
        }
        if missing.is_empty() { "nothing".into() } else { missing.join("; ") }
    }
}

fn cpu_virt_flag(cpuinfo: &str) -> Option<&'static str> {
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags"))?;
    let flags = flags.split_once(':').map_or("", |(_, f)| f);
    flags.split_whitespace().find_map(|f| match f {
        "vmx" => Some("vmx"),
        "svm" => Some("svm"),
        _ => None,
    })
}

/// A resolved backend and the reason for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendChoice {
    pub kind: BackendKind,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(kvm: bool, flag: Option<&'static str>) -> HostVirtualization {
        HostVirtualization {
            kvm_usable: kvm,
            kvm_problem: (!kvm).then(|| "/dev/kvm: No such file or directory".into()),
            cpu_flag: flag,
        }
    }

    #[test]
    fn auto_picks_vm_only_with_kvm_and_hardware_virtualization() {
        assert_eq!(host(true, Some("svm")).choose(BackendKind::Auto).kind, BackendKind::Vm);
        let pvm = host(true, None).choose(BackendKind::Auto);
        assert_eq!(pvm.kind, BackendKind::Jail);
        assert!(pvm.reason.contains("no vmx/svm"), "{}", pvm.reason);
        assert_eq!(host(false, Some("vmx")).choose(BackendKind::Auto).kind, BackendKind::Jail);
        assert_eq!(host(false, None).choose(BackendKind::Vm).kind, BackendKind::Vm);
    }

    #[test]
    fn cpu_flags_are_read_from_cpuinfo() {
        assert_eq!(cpu_virt_flag("processor: 0\nflags\t\t: fpu vme sse2 vmx ept\n"), Some("vmx"));
        assert_eq!(cpu_virt_flag("flags : fpu svm\n"), Some("svm"));
        assert_eq!(cpu_virt_flag("flags : fpu sse2 hypervisor\n"), None);
    }

    #[test]
    fn an_explicit_backend_is_taken_as_asked() {
        for kind in [BackendKind::Jail, BackendKind::Vm] {
            let choice = HostVirtualization::resolve(kind);
            assert_eq!((choice.kind, choice.reason.as_str()), (kind, "requested explicitly"));
        }
    }

    #[test]
    fn probe_reports_a_missing_kvm_device() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cpuinfo = dir.path().join("cpuinfo");
        std::fs::write(&cpuinfo, "flags : svm\n").expect("write");
        let host = HostVirtualization::probe_at(&dir.path().join("kvm"), &cpuinfo);
        assert!(!host.kvm_usable);
        assert!(host.vm_missing().contains("/dev/kvm is not usable"));
    }

    #[test]
    fn backend_names_parse() {
        assert_eq!("jail".parse(), Ok(BackendKind::Jail));
        assert!("docker".parse::<BackendKind>().expect_err("unknown").contains("allowed are auto, vm, jail"));
    }
}
