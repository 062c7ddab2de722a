//! The VM's configuration file (docs/vmm.md): JSON, one object, unknown
//! fields refused. Every field but `kernel` has a default.
//!
//! moat-vmm parses and validates it (`moat_vmm::config`); moat writes it
//! for each microVM it starts.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The command line used when none is given: console on COM1, reboot
/// through the i8042 (which ends the VM), no PCI probing, no PS/2 mouse.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off i8042.noaux i8042.nomux";

/// A locally administered unicast address ("moat" in its middle bytes).
pub const DEFAULT_MAC: &str = "02:6d:6f:61:74:01";

/// A microVM's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// The guest kernel: an ELF `vmlinux` (PVH note used when present) or a bzImage.
    pub kernel: PathBuf,
    /// The initramfs, loaded at the top of low memory.
    #[serde(default)]
    pub initramfs: Option<PathBuf>,
    /// The kernel command line.
    #[serde(default = "default_cmdline")]
    pub cmdline: String,
    /// vCPUs, 1–8.
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// Guest memory in MiB.
    #[serde(default = "default_memory")]
    pub memory_mib: u32,
    /// Block devices, in the order the guest sees them (vda, vdb, …).
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    /// The virtio-vsock device and the host Unix socket behind it.
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    /// The virtio-net device and the passt behind it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<NetConfig>,
    /// Where the serial console goes: `stdout`, `none`, `file:PATH`, `fd:N`.
    #[serde(default = "default_console")]
    pub console: String,
    /// The control socket (JSON lines) to listen on.
    #[serde(default)]
    pub control_socket: Option<PathBuf>,
    /// How long a graceful `shutdown` waits for the guest before stopping it.
    #[serde(default = "default_shutdown_timeout")]
    pub shutdown_timeout_ms: u64,
}

/// A disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    /// The backing file.
    pub path: PathBuf,
    /// Whether the guest may only read it.
    #[serde(default)]
    pub read_only: bool,
    /// A copy-on-write overlay (created when absent): `path` becomes a
    /// read-only base and the guest's writes land here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay: Option<PathBuf>,
    /// The most the overlay may hold, in MiB of written blocks; a write past
    /// it fails in the guest with an I/O error. Default: the disk's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay_limit_mib: Option<u64>,
}

impl DiskConfig {
    /// A plain disk.
    pub fn new(path: impl Into<PathBuf>, read_only: bool) -> Self {
        Self { path: path.into(), read_only, overlay: None, overlay_limit_mib: None }
    }
}

/// The vsock device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// The guest's context id (3 and up; 0–2 are reserved).
    pub cid: u32,
    /// The host Unix socket that guest connections arrive on and host
    /// connections are made through (`CONNECT <port>\n`).
    pub uds_path: PathBuf,
    /// The host ports the guest may connect to (each reached at
    /// `<uds_path>_<port>`); absent: any. With none, the VMM makes no
    /// connection after it starts, and its seccomp filter allows none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_ports: Option<Vec<u32>>,
}

impl VsockConfig {
    /// A device whose guest may connect to any host port.
    pub fn new(cid: u32, uds_path: impl Into<PathBuf>) -> Self {
        Self { cid, uds_path: uds_path.into(), host_ports: None }
    }

    /// Whether the guest may open connections to the host at all.
    pub fn guest_connects(&self) -> bool {
        self.host_ports.as_ref().is_none_or(|ports| !ports.is_empty())
    }
}

/// The network device: frames go to and come from passt, in its default
/// ("qemu") mode, over a stream socket: either its listening socket
/// (`passt --socket PATH`) or a descriptor already connected to it (one
/// end of a socketpair whose other end passt got with `--fd`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// passt's Unix socket, connected when the VM is built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passt_socket: Option<PathBuf>,
    /// An inherited descriptor (above 2) connected to passt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passt_fd: Option<i32>,
    /// The guest's MAC address, `xx:xx:xx:xx:xx:xx` (unicast).
    #[serde(default = "default_mac")]
    pub mac: String,
}

impl NetConfig {
    /// A device connected to passt's socket at `path`, with the default MAC.
    pub fn socket(path: impl Into<PathBuf>) -> Self {
        Self { passt_socket: Some(path.into()), passt_fd: None, mac: default_mac() }
    }

    /// A device connected to passt through the inherited descriptor `fd`,
    /// with the default MAC.
    pub fn fd(fd: i32) -> Self {
        Self { passt_socket: None, passt_fd: Some(fd), mac: default_mac() }
    }
}

fn default_cmdline() -> String {
    DEFAULT_CMDLINE.to_owned()
}
fn default_vcpus() -> u8 {
    1
}
fn default_memory() -> u32 {
    256
}
fn default_console() -> String {
    "stdout".to_owned()
}
fn default_shutdown_timeout() -> u64 {
    5000
}
fn default_mac() -> String {
    DEFAULT_MAC.to_owned()
}

impl VmConfig {
    /// A configuration with defaults for everything but the kernel.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        Self {
            kernel: kernel.into(),
            initramfs: None,
            cmdline: default_cmdline(),
            vcpus: default_vcpus(),
            memory_mib: default_memory(),
            disks: Vec::new(),
            vsock: None,
            net: None,
            console: default_console(),
            control_socket: None,
            shutdown_timeout_ms: default_shutdown_timeout(),
        }
    }

    /// Guest memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        u64::from(self.memory_mib) << 20
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_kernel_is_required() {
        let config: VmConfig = serde_json::from_str(r#"{"kernel": "/k"}"#).expect("parses");
        assert_eq!(config, VmConfig::new("/k"));
        assert_eq!(config.memory_bytes(), 256 << 20);
        let e = serde_json::from_str::<VmConfig>(r#"{"kernel": "/k", "vcpu": 2}"#).expect_err("unknown field");
        assert!(e.to_string().contains("unknown field `vcpu`"), "{e}");
    }

    #[test]
    fn a_written_configuration_reads_back_the_same() {
        let mut config = VmConfig::new("/k");
        config.disks = vec![DiskConfig {
            overlay: Some("/o".into()),
            overlay_limit_mib: Some(64),
            ..DiskConfig::new("/d", false)
        }];
        config.vsock = Some(VsockConfig { host_ports: Some(Vec::new()), ..VsockConfig::new(3, "/v.sock") });
        config.net = Some(NetConfig::fd(100));
        let text = serde_json::to_string(&config).expect("serializes");
        assert_eq!(serde_json::from_str::<VmConfig>(&text).expect("parses"), config);
        let absent = serde_json::to_value(VmConfig::new("/k")).expect("serializes");
        assert!(absent.get("net").is_none(), "no network device, no net section: {absent}");
    }

    #[test]
    fn an_empty_host_port_list_means_no_guest_connections() {
        let mut vsock = VsockConfig::new(3, "/v.sock");
        assert!(vsock.guest_connects());
        vsock.host_ports = Some(vec![]);
        assert!(!vsock.guest_connects());
        vsock.host_ports = Some(vec![52]);
        assert!(vsock.guest_connects());
    }
}
