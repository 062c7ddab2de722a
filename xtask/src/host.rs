//! The host: running commands, and the Debian packages tasks need.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, bail};

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

pub use moat_image::host::{is_root, output};

/// Runs `command` in the workspace root, echoing it; fails on a non-zero exit.
pub fn run(command: &mut Command) -> Result<()> {
    if command.get_current_dir().is_none() {
        command.current_dir(root());
    }
    moat_image::host::run(command)
}

pub fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// Packages every task needs, each with a program it provides (to tell
/// whether it is installed).
pub const BASE_PACKAGES: &[(&str, &str)] = &[
    // unshare and setpriv: the agent's PID 1 and privilege tests.
    ("util-linux", "unshare"),
    ("util-linux", "setpriv"),
    // ldd: proving the agent is static.
    ("libc-bin", "ldd"),
    ("coreutils", "sha256sum"),
    ("procps", "ps"),
    // openssl: the CA certificates the MOAT_CA_FILE tests make.
    ("openssl", "openssl"),
];

/// Installs missing host packages with apt-get when root, or says exactly
/// what to install.
pub fn ensure_packages(packages: &[(&str, &str)]) -> Result<()> {
    moat_image::host::ensure_packages(packages).map(|_| ())
}

/// Makes `/dev/net/tun` usable by pasta, which runs as the sandbox's
/// unprivileged uid: some machines ship it mode 0600. As root the gate
/// sets Debian's usual 0666 (and says so); otherwise it says what to run.
/// `moat doctor` reports the same problem to users.
pub fn ensure_tun() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    const TUN: &str = "/dev/net/tun";
    let mode = match std::fs::metadata(TUN) {
        Ok(meta) => meta.permissions().mode() & 0o7777,
        Err(e) => bail!("{TUN}: {e}; load the tun module (`modprobe tun`) so the network tests can run pasta"),
    };
    if mode & 0o006 == 0o006 {
        return Ok(());
    }
    if !is_root() {
        bail!("{TUN} is mode {mode:04o}, which stops pasta (network `open`); run: sudo chmod 0666 {TUN}");
    }
    eprintln!("xtask: {TUN} was mode {mode:04o}, which stops rootless pasta; setting Debian's usual 0666");
    std::fs::set_permissions(TUN, std::fs::Permissions::from_mode(0o666))?;
    Ok(())
}
