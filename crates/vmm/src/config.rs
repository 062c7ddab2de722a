//! The VM's configuration: parsed from JSON (or assembled from flags by the
//! binary), then validated field by field so that a mistake is reported as
//! one line naming the field and what is wrong with it. The types are
//! moat-vmm-api's, shared with moat, which writes the file.

use std::path::{Path, PathBuf};

pub use moat_vmm_api::config::{DEFAULT_CMDLINE, DEFAULT_MAC, DiskConfig, NetConfig, VmConfig, VsockConfig};

use crate::arch::x86_64::layout::{CMDLINE_MAX_SIZE, MAX_MEM_MIB, MAX_VCPUS, MIN_MEM_MIB};

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

/// Parses a JSON configuration (not yet validated).
pub fn from_json(text: &str) -> Result<VmConfig, ConfigError> {
    serde_json::from_str(text).map_err(|e| {
        // serde names the field in its message ("unknown field `x`",
        // "missing field `kernel`", "invalid type … at line 3").
        invalid("config", e.to_string())
    })
}

/// Checks every field of `config`; the first problem found is returned.
pub fn validate(config: &VmConfig) -> Result<(), ConfigError> {
    require_file("kernel", &config.kernel)?;
    if let Some(initramfs) = &config.initramfs {
        require_file("initramfs", initramfs)?;
    }
    if config.cmdline.len() >= CMDLINE_MAX_SIZE {
        return Err(invalid(
            "cmdline",
            format!("{} bytes long; the kernel takes at most {}", config.cmdline.len(), CMDLINE_MAX_SIZE - 1),
        ));
    }
    if config.cmdline.contains('\0') {
        return Err(invalid("cmdline", "contains a NUL byte"));
    }
    if !(1..=MAX_VCPUS).contains(&config.vcpus) {
        return Err(invalid("vcpus", format!("{} is out of range; use 1 to {MAX_VCPUS}", config.vcpus)));
    }
    if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&config.memory_mib) {
        return Err(invalid(
            "memory_mib",
            format!("{} is out of range; use {MIN_MEM_MIB} to {MAX_MEM_MIB}", config.memory_mib),
        ));
    }
    for (i, disk) in config.disks.iter().enumerate() {
        require_file(&format!("disks[{i}].path"), &disk.path)?;
        let shared_base = |d: &DiskConfig| d.overlay.is_some() && disk.overlay.is_some();
        if config.disks[..i].iter().any(|d| d.path == disk.path && !shared_base(d)) {
            return Err(invalid(format!("disks[{i}].path"), "the same file is attached twice"));
        }
        validate_overlay(i, disk, &config.disks[..i])?;
    }
    let max_disks = 16;
    if config.disks.len() > max_disks {
        return Err(invalid("disks", format!("{} disks; at most {max_disks}", config.disks.len())));
    }
    if let Some(vsock) = &config.vsock {
        if vsock.cid < 3 || vsock.cid == u32::MAX {
            return Err(invalid("vsock.cid", format!("{} is reserved; use 3 or more", vsock.cid)));
        }
        require_socket_dir("vsock.uds_path", &vsock.uds_path)?;
    }
    if let Some(net) = &config.net {
        validate_net(net)?;
    }
    console(config)?;
    if let Some(path) = &config.control_socket {
        require_socket_dir("control_socket", path)?;
    }
    if config.shutdown_timeout_ms == 0 || config.shutdown_timeout_ms > 3_600_000 {
        return Err(invalid("shutdown_timeout_ms", "use 1 ms to 1 hour"));
    }
    Ok(())
}

/// Where `config` sends the console.
pub fn console(config: &VmConfig) -> Result<Console, ConfigError> {
    let c = config.console.as_str();
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

/// The network device's MAC address as bytes.
pub fn mac_bytes(net: &NetConfig) -> Result<[u8; 6], ConfigError> {
    let bad =
        || invalid("net.mac", format!("{:?} is not a MAC address; write six hex bytes, 02:00:00:00:00:01", net.mac));
    let mut mac = [0u8; 6];
    let mut parts = net.mac.split(':');
    for byte in &mut mac {
        let part = parts.next().filter(|p| p.len() == 2).ok_or_else(bad)?;
        *byte = u8::from_str_radix(part, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() {
        return Err(bad());
    }
    if mac[0] & 1 != 0 || mac == [0; 6] {
        return Err(invalid("net.mac", format!("{} is not a unicast address; the first byte must be even", net.mac)));
    }
    Ok(mac)
}

fn validate_net(net: &NetConfig) -> Result<(), ConfigError> {
    mac_bytes(net)?;
    match (&net.passt_socket, net.passt_fd) {
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
        let config = from_json(&text).expect("parses");
        assert_eq!(config, VmConfig::new(k.path()));
        validate(&config).expect("valid");
        assert_eq!(console(&config), Ok(Console::Stdout));
        assert_eq!(config.memory_bytes(), 256 << 20);
    }

    #[test]
    fn unknown_and_missing_fields_are_named() {
        let e = from_json(r#"{"kernel": "/k", "vcpu": 2}"#).expect_err("unknown field");
        assert!(e.to_string().contains("unknown field `vcpu`"), "{e}");
        let e = from_json(r#"{"vcpus": 2}"#).expect_err("no kernel");
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
                Box::new(|c| {
                    c.net = Some(NetConfig { passt_socket: None, passt_fd: Some(1), mac: DEFAULT_MAC.into() })
                }),
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
            let e = validate(&config).expect_err(field);
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
        assert_eq!(validate(&config).expect_err("twice").field, "disks[1].path");
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
        let config = from_json(&text).expect("parses");
        assert_eq!(config.disks[0].overlay_limit_mib, Some(64));
        validate(&config).expect("one base under two overlays is fine");
        let mut twice = config.clone();
        twice.disks[1].overlay = twice.disks[0].overlay.clone();
        assert_eq!(validate(&twice).expect_err("one overlay twice").field, "disks[1].overlay");
    }

    #[test]
    fn a_net_section_parses_with_a_default_mac() {
        let k = kernel();
        let dir = tempfile::tempdir().expect("temp dir");
        let sock = dir.path().join("passt.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).expect("binds");
        let text = format!(r#"{{"kernel": {:?}, "net": {{"passt_socket": {sock:?}}}}}"#, k.path());
        let config = from_json(&text).expect("parses");
        validate(&config).expect("valid");
        let net = config.net.expect("net");
        assert_eq!(mac_bytes(&net), Ok([0x02, 0x6d, 0x6f, 0x61, 0x74, 0x01]));
        let e = from_json(r#"{"kernel": "/k", "net": {"passt": "/x"}}"#).expect_err("unknown field");
        assert!(e.to_string().contains("unknown field `passt`"), "{e}");
    }

    #[test]
    fn console_destinations_parse() {
        let mut config = VmConfig::new("/k");
        for (text, want) in
            [("none", Console::None), ("file:log.txt", Console::File("log.txt".into())), ("fd:5", Console::Fd(5))]
        {
            config.console = text.into();
            assert_eq!(console(&config), Ok(want));
        }
    }
}
