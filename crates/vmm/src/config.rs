//! The VM's configuration: parsed from JSON (or assembled from flags by the
//! binary), then validated field by field so that a mistake is reported as
//! one line naming the field and what is wrong with it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::arch::x86_64::layout::{CMDLINE_MAX_SIZE, MAX_MEM_MIB, MAX_VCPUS, MIN_MEM_MIB};

/// The command line used when none is given: console on COM1, reboot
/// through the i8042 (which ends the VM), no PCI probing, no PS/2 mouse.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off i8042.noaux i8042.nomux";

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

/// A locally administered unicast address ("moat" in its middle bytes).
pub const DEFAULT_MAC: &str = "02:6d:6f:61:74:01";

fn default_mac() -> String {
    DEFAULT_MAC.to_owned()
}

impl NetConfig {
    /// A device connected to passt's socket at `path`, with the default MAC.
    pub fn socket(path: impl Into<PathBuf>) -> Self {
        Self { passt_socket: Some(path.into()), passt_fd: None, mac: default_mac() }
    }

    /// The MAC address as bytes.
    pub fn mac_bytes(&self) -> Result<[u8; 6], ConfigError> {
        let bad = || {
            invalid("net.mac", format!("{:?} is not a MAC address; write six hex bytes, 02:00:00:00:00:01", self.mac))
        };
        let mut mac = [0u8; 6];
        let mut parts = self.mac.split(':');
        for byte in &mut mac {
            let part = parts.next().filter(|p| p.len() == 2).ok_or_else(bad)?;
            *byte = u8::from_str_radix(part, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        if mac[0] & 1 != 0 || mac == [0; 6] {
            return Err(invalid(
                "net.mac",
                format!("{} is not a unicast address; the first byte must be even", self.mac),
            ));
        }
        Ok(mac)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.mac_bytes()?;
        match (&self.passt_socket, self.passt_fd) {
            (Some(_), Some(_)) | (None, None) => Err(invalid(
                "net",
                "give passt_socket (passt's socket path) or passt_fd (a connected descriptor), one of them",
            )),
            (Some(path), None) => {
                use std::os::unix::fs::FileTypeExt;
                match std::fs::metadata(path) {
                    Ok(m) if m.file_type().is_socket() => Ok(()),
                    Ok(_) => Err(invalid("net.passt_socket", format!("{} is not a socket", path.display()))),
                    Err(e) => Err(invalid(
                        "net.passt_socket",
                        format!("cannot reach {}: {e}; start passt with --socket there first", path.display()),
                    )),
                }
            }
            (None, Some(fd)) if fd > 2 => Ok(()),
            (None, Some(fd)) => Err(invalid("net.passt_fd", format!("{fd} is not an inherited descriptor above 2"))),
        }
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

/// Where the console goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Console {
    /// The VMM's standard output (and input from its standard input).
    Stdout,
    /// Nowhere.
    None,
    /// Appended to a file (created if needed).
    File(PathBuf),
    /// An inherited file descriptor (a pipe, a socket).
    Fd(i32),
}

/// A configuration mistake: which field, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Invalid configuration: {field}: {reason}")]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), reason: reason.into() }
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

    /// Parses a JSON configuration (not yet validated).
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        serde_json::from_str(text).map_err(|e| {
            // serde names the field in its message ("unknown field `x`",
            // "missing field `kernel`", "invalid type … at line 3").
            invalid("config", e.to_string())
        })
    }

    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        require_file("kernel", &self.kernel)?;
        if let Some(initramfs) = &self.initramfs {
            require_file("initramfs", initramfs)?;
        }
        if self.cmdline.len() >= CMDLINE_MAX_SIZE {
            return Err(invalid(
                "cmdline",
                format!("{} bytes long; the kernel takes at most {}", self.cmdline.len(), CMDLINE_MAX_SIZE - 1),
            ));
        }
        if self.cmdline.contains('\0') {
            return Err(invalid("cmdline", "contains a NUL byte"));
        }
        if !(1..=MAX_VCPUS).contains(&self.vcpus) {
            return Err(invalid("vcpus", format!("{} is out of range; use 1 to {MAX_VCPUS}", self.vcpus)));
        }
        if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&self.memory_mib) {
            return Err(invalid(
                "memory_mib",
                format!("{} is out of range; use {MIN_MEM_MIB} to {MAX_MEM_MIB}", self.memory_mib),
            ));
        }
        for (i, disk) in self.disks.iter().enumerate() {
            require_file(&format!("disks[{i}].path"), &disk.path)?;
            let shared_base = |d: &DiskConfig| d.overlay.is_some() && disk.overlay.is_some();
            if self.disks[..i].iter().any(|d| d.path == disk.path && !shared_base(d)) {
                return Err(invalid(format!("disks[{i}].path"), "the same file is attached twice"));
            }
            validate_overlay(i, disk, &self.disks[..i])?;
        }
        let max_disks = 16;
        if self.disks.len() > max_disks {
            return Err(invalid("disks", format!("{} disks; at most {max_disks}", self.disks.len())));
        }
        if let Some(vsock) = &self.vsock {
            if vsock.cid < 3 || vsock.cid == u32::MAX {
                return Err(invalid("vsock.cid", format!("{} is reserved; use 3 or more", vsock.cid)));
            }
            require_socket_dir("vsock.uds_path", &vsock.uds_path)?;
        }
        if let Some(net) = &self.net {
            net.validate()?;
        }
        self.console()?;
        if let Some(path) = &self.control_socket {
            require_socket_dir("control_socket", path)?;
        }
        if self.shutdown_timeout_ms == 0 || self.shutdown_timeout_ms > 3_600_000 {
            return Err(invalid("shutdown_timeout_ms", "use 1 ms to 1 hour"));
        }
        Ok(())
    }

    /// The console destination.
    pub fn console(&self) -> Result<Console, ConfigError> {
        let c = self.console.as_str();
        match c.split_once(':') {
            None if c == "stdout" => Ok(Console::Stdout),
            None if c == "none" => Ok(Console::None),
            Some(("file", path)) if !path.is_empty() => {
                let path = PathBuf::from(path);
                match path.parent() {
                    Some(dir) if dir.as_os_str().is_empty() || dir.is_dir() => Ok(Console::File(path)),
                    _ => Err(invalid("console", format!("the directory of {} does not exist", path.display()))),
                }
            }
            Some(("fd", n)) => match n.parse::<i32>() {
                Ok(fd) if fd > 2 => Ok(Console::Fd(fd)),
                _ => Err(invalid("console", format!("fd:{n} is not an inherited descriptor above 2"))),
            },
            _ => Err(invalid("console", format!("{c:?}; use stdout, none, file:PATH or fd:N"))),
        }
    }

    /// Guest memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        u64::from(self.memory_mib) << 20
    }
}

fn validate_overlay(i: usize, disk: &DiskConfig, earlier: &[DiskConfig]) -> Result<(), ConfigError> {
    let field = format!("disks[{i}].overlay");
    match (&disk.overlay, disk.overlay_limit_mib) {
        (None, Some(_)) => {
            return Err(invalid(format!("disks[{i}].overlay_limit_mib"), "needs an overlay"));
        }
        (Some(_), Some(0)) => {
            return Err(invalid(format!("disks[{i}].overlay_limit_mib"), "0; use 1 or more"));
        }
        (Some(_), Some(mib)) if mib > 1 << 30 => {
            return Err(invalid(format!("disks[{i}].overlay_limit_mib"), format!("{mib} is more than 1 PiB")));
        }
        _ => {}
    }
    let Some(overlay) = &disk.overlay else { return Ok(()) };
    if disk.read_only {
        return Err(invalid(field, "a read-only disk takes no overlay; drop one of them"));
    }
    if overlay == &disk.path || earlier.iter().any(|d| &d.path == overlay || d.overlay.as_ref() == Some(overlay)) {
        return Err(invalid(field, format!("{} is already used by another disk", overlay.display())));
    }
    match std::fs::metadata(overlay) {
        Ok(m) if !m.is_file() => Err(invalid(field, format!("{} is not a regular file", overlay.display()))),
        Ok(_) => Ok(()),
        Err(_) => match overlay.parent() {
            Some(dir) if dir.as_os_str().is_empty() || dir.is_dir() => Ok(()),
            _ => Err(invalid(field, format!("the directory of {} does not exist", overlay.display()))),
        },
    }
}

fn require_file(field: &str, path: &Path) -> Result<(), ConfigError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(invalid(field, format!("{} is not a regular file", path.display()))),
        Err(e) => Err(invalid(field, format!("cannot read {}: {e}", path.display()))),
    }
}

fn require_socket_dir(field: &str, path: &Path) -> Result<(), ConfigError> {
    // sun_path holds 108 bytes, NUL included.
    if path.as_os_str().len() > 107 {
        return Err(invalid(field, format!("{} is longer than a Unix socket path may be (107 bytes)", path.display())));
    }
    match path.parent() {
        Some(dir) if dir.as_os_str().is_empty() || dir.is_dir() => Ok(()),
        _ => Err(invalid(field, format!("the directory of {} does not exist", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel() -> tempfile::NamedTempFile {
        tempfile::NamedTempFile::new().expect("temp file")
    }

    #[test]
    fn json_with_defaults_is_valid() {
        let k = kernel();
        let text = format!(r#"{{"kernel": {:?}}}"#, k.path());
        let config = VmConfig::from_json(&text).expect("parses");
        assert_eq!(config, VmConfig::new(k.path()));
        config.validate().expect("valid");
        assert_eq!(config.console(), Ok(Console::Stdout));
        assert_eq!(config.memory_bytes(), 256 << 20);
    }

    #[test]
    fn unknown_and_missing_fields_are_named() {
        let e = VmConfig::from_json(r#"{"kernel": "/k", "vcpu": 2}"#).expect_err("unknown field");
        assert!(e.to_string().contains("unknown field `vcpu`"), "{e}");
        let e = VmConfig::from_json(r#"{"vcpus": 2}"#).expect_err("no kernel");
        assert!(e.to_string().contains("missing field `kernel`"), "{e}");
    }

    #[test]
    fn each_bad_field_is_reported_by_name() {
        let k = kernel();
        let dir = tempfile::tempdir().expect("temp dir");
        let (k2, k3, k4, k5) = (k.path().to_owned(), k.path().to_owned(), k.path().to_owned(), k.path().to_owned());
        type Change = Box<dyn Fn(&mut VmConfig)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|c| c.kernel = "/nonexistent/vmlinux".into()), "kernel"),
            (Box::new(|c| c.initramfs = Some("/".into())), "initramfs"),
            (Box::new(|c| c.vcpus = 0), "vcpus"),
            (Box::new(|c| c.vcpus = 9), "vcpus"),
            (Box::new(|c| c.memory_mib = 1), "memory_mib"),
            (Box::new(|c| c.cmdline = "x".repeat(4096)), "cmdline"),
            (Box::new(|c| c.console = "tty".into()), "console"),
            (Box::new(|c| c.console = "fd:1".into()), "console"),
            (Box::new(|c| c.console = "file:/nonexistent/dir/log".into()), "console"),
            (Box::new(|c| c.control_socket = Some("/nonexistent/dir/ctl".into())), "control_socket"),
            (Box::new(|c| c.vsock = Some(VsockConfig::new(2, "/tmp/v.sock"))), "vsock.cid"),
            (Box::new(|c| c.disks = vec![DiskConfig::new("/nonexistent", false)]), "disks[0].path"),
            (
                Box::new(move |c| {
                    c.disks =
                        vec![DiskConfig { overlay: Some("/nonexistent/dir/ov".into()), ..DiskConfig::new(&k2, false) }]
                }),
                "disks[0].overlay",
            ),
            (
                Box::new(move |c| {
                    c.disks = vec![DiskConfig { overlay: Some("/tmp/ov".into()), ..DiskConfig::new(&k3, true) }]
                }),
                "disks[0].overlay",
            ),
            (
                Box::new(move |c| {
                    c.disks = vec![DiskConfig { overlay_limit_mib: Some(5), ..DiskConfig::new(&k4, false) }]
                }),
                "disks[0].overlay_limit_mib",
            ),
            (
                Box::new(move |c| {
                    c.disks = vec![DiskConfig {
                        overlay: Some("/tmp/ov".into()),
                        overlay_limit_mib: Some(0),
                        ..DiskConfig::new(&k5, false)
                    }]
                }),
                "disks[0].overlay_limit_mib",
            ),
            (Box::new(|c| c.shutdown_timeout_ms = 0), "shutdown_timeout_ms"),
            (Box::new(|c| c.net = Some(NetConfig { passt_fd: Some(5), ..NetConfig::socket("/tmp") })), "net"),
            (Box::new(|c| c.net = Some(NetConfig { passt_socket: None, ..NetConfig::socket("/") })), "net"),
            (Box::new(|c| c.net = Some(NetConfig::socket("/nonexistent/passt.sock"))), "net.passt_socket"),
            (Box::new(|c| c.net = Some(NetConfig::socket("/"))), "net.passt_socket"),
            (
                Box::new(|c| c.net = Some(NetConfig { passt_socket: None, passt_fd: Some(1), mac: default_mac() })),
                "net.passt_fd",
            ),
            (
                Box::new(|c| c.net = Some(NetConfig { mac: "01:00:00:00:00:01".into(), ..NetConfig::socket("/") })),
                "net.mac",
            ),
            (
                Box::new(|c| c.net = Some(NetConfig { mac: "02:00:00:00:00".into(), ..NetConfig::socket("/") })),
                "net.mac",
            ),
            (
                Box::new(|c| c.net = Some(NetConfig { mac: "02:00:00:00:00:0g".into(), ..NetConfig::socket("/") })),
                "net.mac",
            ),
        ];
        for (change, field) in cases {
            let mut config = VmConfig::new(k.path());
            config.control_socket = Some(dir.path().join("ctl.sock"));
            change(&mut config);
            let e = config.validate().expect_err(field);
            assert_eq!(e.field, field, "{e}");
            assert!(e.to_string().starts_with(&format!("Invalid configuration: {field}: ")), "{e}");
            assert!(!e.to_string().contains('\n'), "one line: {e}");
        }
    }

    #[test]
    fn a_disk_attached_twice_is_refused() {
        let k = kernel();
        let disk = DiskConfig::new(k.path(), true);
        let mut config = VmConfig::new(k.path());
        config.disks = vec![disk.clone(), disk];
        assert_eq!(config.validate().expect_err("twice").field, "disks[1].path");
    }

    #[test]
    fn overlays_parse_and_may_share_a_base() {
        let k = kernel();
        let dir = tempfile::tempdir().expect("temp dir");
        let text = format!(
            r#"{{"kernel": {k:?}, "disks": [{{"path": {k:?}, "overlay": {a:?}, "overlay_limit_mib": 64}},
                {{"path": {k:?}, "overlay": {b:?}}}]}}"#,
            k = k.path(),
            a = dir.path().join("a.img"),
            b = dir.path().join("b.img"),
        );
        let config = VmConfig::from_json(&text).expect("parses");
        assert_eq!(config.disks[0].overlay_limit_mib, Some(64));
        config.validate().expect("one base under two overlays is fine");
        let mut twice = config.clone();
        twice.disks[1].overlay = twice.disks[0].overlay.clone();
        assert_eq!(twice.validate().expect_err("one overlay twice").field, "disks[1].overlay");
    }

    #[test]
    fn a_net_section_parses_with_a_default_mac() {
        let k = kernel();
        let dir = tempfile::tempdir().expect("temp dir");
        let sock = dir.path().join("passt.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).expect("binds");
        let text = format!(r#"{{"kernel": {:?}, "net": {{"passt_socket": {sock:?}}}}}"#, k.path());
        let config = VmConfig::from_json(&text).expect("parses");
        config.validate().expect("valid");
        let net = config.net.expect("net");
        assert_eq!(net.mac_bytes(), Ok([0x02, 0x6d, 0x6f, 0x61, 0x74, 0x01]));
        let e = VmConfig::from_json(r#"{"kernel": "/k", "net": {"passt": "/x"}}"#).expect_err("unknown field");
        assert!(e.to_string().contains("unknown field `passt`"), "{e}");
    }

    #[test]
    fn console_destinations_parse() {
        let mut config = VmConfig::new("/k");
        for (text, want) in
            [("none", Console::None), ("file:log.txt", Console::File("log.txt".into())), ("fd:5", Console::Fd(5))]
        {
            config.console = text.into();
            assert_eq!(config.console(), Ok(want));
        }
    }
}
