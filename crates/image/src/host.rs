//! The host the image is built on: running its tools, and the Debian
//! packages they come from.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Runs `command`, echoing it to stderr; fails on a non-zero exit.
pub fn run(command: &mut Command) -> Result<()> {
    eprintln!("$ {}", describe(command));
    let status = command.status().with_context(|| format!("cannot start {}", describe(command)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(command));
    }
    Ok(())
}

/// Runs `command` and returns its stdout and stderr.
pub fn output(command: &mut Command) -> Result<String> {
    let out = command.output().with_context(|| format!("cannot start {}", describe(command)))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

fn describe(command: &Command) -> String {
    let mut parts = vec![command.get_program().to_string_lossy().into_owned()];
    parts.extend(command.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
}

/// The Debian packages of `packages` (each with a program it provides, to
/// tell whether it is installed) that are missing, sorted, once each.
pub fn missing_packages<'a>(packages: &[(&'a str, &str)]) -> Vec<&'a str> {
    let mut missing: Vec<&str> = packages.iter().filter(|(_, program)| !on_path(program)).map(|(p, _)| *p).collect();
    missing.sort_unstable();
    missing.dedup();
    missing
}

/// Installs the missing ones of `packages` with apt-get when root, or says
/// exactly what to install. Returns the packages it installed.
pub fn ensure_packages<'a>(packages: &[(&'a str, &str)]) -> Result<Vec<&'a str>> {
    let missing = missing_packages(packages);
    if missing.is_empty() {
        return Ok(missing);
    }
    if !is_root() || !on_path("apt-get") {
        bail!(
            "missing host packages: {}; install them with: sudo apt-get install -y {}",
            missing.join(", "),
            missing.join(" ")
        );
    }
    run(Command::new("apt-get").arg("update").arg("-q"))?;
    // What is installed here starts no service on this machine (an sshd
    // listening on port 22 among the test packages): Debian's policy-rc.d
    // says no to every start while they install, unless the machine has
    // its own.
    let policy = std::path::Path::new("/usr/sbin/policy-rc.d");
    let ours = !policy.exists();
    if ours {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(policy, "#!/bin/sh\n# moat, while it installs host packages\nexit 101\n")?;
        std::fs::set_permissions(policy, std::fs::Permissions::from_mode(0o755))?;
    }
    let installed = run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"));
    if ours {
        std::fs::remove_file(policy)?;
    }
    installed.map(|()| missing)
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

/// Whether this process runs as root.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}
