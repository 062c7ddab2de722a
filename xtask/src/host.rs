//! The host: running commands, and the Debian packages tasks need.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Runs `command` in the workspace root, echoing it; fails on a non-zero exit.
pub fn run(command: &mut Command) -> Result<()> {
    if command.get_current_dir().is_none() {
        command.current_dir(root());
    }
    eprintln!("$ {}", describe(command));
    let status = command.status().with_context(|| format!("cannot start {}", describe(command)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(command));
    }
    Ok(())
}

/// Runs `command` and returns its stdout.
pub fn output(command: &mut Command) -> Result<String> {
    let out = command.output().with_context(|| format!("cannot start {}", describe(command)))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

fn describe(command: &Command) -> String {
    let mut parts = vec![command.get_program().to_string_lossy().into_owned()];
    parts.extend(command.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
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
    let mut missing: Vec<&str> = packages.iter().filter(|(_, program)| !on_path(program)).map(|(p, _)| *p).collect();
    missing.sort_unstable();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() || !on_path("apt-get") {
        bail!(
            "missing host packages: {}; install them with: sudo apt-get install -y {}",
            missing.join(", "),
            missing.join(" ")
        );
    }
    run(Command::new("apt-get").arg("update").arg("-q"))?;
    // Packages the tests need start no service on this machine (an sshd
    // listening on port 22 among them): Debian's policy-rc.d says no to
    // every start while they install, unless the machine has its own.
    let policy = std::path::Path::new("/usr/sbin/policy-rc.d");
    let ours = !policy.exists();
    if ours {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(policy, "#!/bin/sh\n# moat's xtask, while it installs test packages\nexit 101\n")?;
        std::fs::set_permissions(policy, std::fs::Permissions::from_mode(0o755))?;
    }
    let installed = run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"));
    if ours {
        std::fs::remove_file(policy)?;
    }
    installed
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

/// Whether `program` is installed, on PATH or in the sbin directories a
/// non-login root shell may lack.
pub fn on_path(program: &str) -> bool {
    let sbin = ["/usr/sbin", "/sbin"].map(PathBuf::from);
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(sbin)
        .any(|dir| dir.join(program).is_file())
}

pub fn is_root() -> bool {
    // The uid of the xtask process: `id -u` avoids a libc dependency here.
    output(Command::new("id").arg("-u")).is_ok_and(|uid| uid.trim() == "0")
}
