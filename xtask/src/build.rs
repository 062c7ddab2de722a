//! Building the binaries: the host binaries, and the agent linked statically.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};

use crate::host::{cargo, output, root, run};

/// The only target there is; naming it makes RUSTFLAGS apply to the agent
/// and not to build scripts and proc macros.
const TARGET: &str = "x86_64-unknown-linux-gnu";

const HOST_BINARIES: &[&str] = &["moat-mcp", "moat", "moat-vmm"];

/// Builds the static agent (release) and checks that it is static.
pub fn static_agent() -> Result<PathBuf> {
    let mut command = cargo();
    command
        .args(["build", "--release", "--package", "moat-agent-bin", "--bin", "moat-agent", "--target", TARGET])
        .env("RUSTFLAGS", "-C target-feature=+crt-static");
    run(&mut command)?;
    let agent = root().join("target").join(TARGET).join("release/moat-agent");
    let ldd = output(Command::new("ldd").arg(&agent))?;
    if !(ldd.contains("not a dynamic executable") || ldd.contains("statically linked")) {
        bail!("{} is dynamically linked; ldd says:\n{ldd}", agent.display());
    }
    Ok(agent)
}

/// Builds the host binaries (release).
pub fn host_binaries_release() -> Result<()> {
    let mut command = cargo();
    command.args(["build", "--release"]);
    for bin in HOST_BINARIES {
        command.args(["--bin", bin]);
    }
    run(&mut command)
}

pub fn build_all() -> Result<()> {
    let agent = static_agent()?;
    host_binaries_release()?;
    let host: Vec<PathBuf> = HOST_BINARIES.iter().map(|b| root().join("target/release").join(b)).collect();
    println!("built:");
    println!("  {:<12} {} (static)", "moat-agent", agent.display());
    for path in &host {
        println!("  {:<12} {}", path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default(), path.display());
    }
    Ok(())
}
