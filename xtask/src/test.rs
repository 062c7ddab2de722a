//! `cargo xtask test` and `cargo xtask bench`.

use anyhow::Result;

use crate::build;
use crate::host::{cargo, ensure_packages, run};

pub fn gate() -> Result<()> {
    ensure_packages()?;
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    build::static_agent()?;
    run(cargo().args(["test", "--workspace", "--no-fail-fast"]))?;
    fuzz_target_builds()
}

/// The decoder's fuzz target must keep compiling; `cargo check` is enough
/// (running it needs cargo-fuzz; see crates/proto/fuzz/README.md).
fn fuzz_target_builds() -> Result<()> {
    run(cargo().args(["check", "--manifest-path", "crates/proto/fuzz/Cargo.toml", "--bins"]))
}

pub fn bench() -> Result<()> {
    ensure_packages()?;
    run(cargo().args(["bench", "--package", "moat-agent-bin", "--bench", "agent"]))
}
