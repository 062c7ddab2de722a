//! `cargo xtask demo`: moat end to end, through a real MCP client.
//!
//! Builds what it needs (the binaries, the default image, the Python MCP
//! SDK), starts `moat-mcp` over stdio under the official Python SDK, and runs
//! a scripted session (`demo_client.py`): create a sandbox, run a command,
//! draw a plot with matplotlib (copied out to `target/demo/plot.png`),
//! import a small project as a task, change it and show the diff. Then it
//! prints how to add moat to an agent host.

#![allow(clippy::print_stdout)]

use std::process::Command;

use anyhow::{Context, Result};

use crate::host::{BASE_PACKAGES, ensure_packages, root, run};
use crate::{build, image, test};

pub fn run_demo() -> Result<()> {
    ensure_packages(BASE_PACKAGES)?;
    build::build_all()?;
    image::build("default", false)?;
    let pythons = test::mcp_sdks()?;
    let python = pythons.split(':').next_back().context("no Python MCP SDK")?.to_owned();
    let out = root().join("target/demo");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let server = root().join("target/release/moat-mcp");
    let agent = root().join("target/x86_64-unknown-linux-gnu/release/moat-agent");
    run(Command::new(python)
        .arg(root().join("xtask/src/demo_client.py"))
        .arg(&server)
        .arg(&out)
        .env("MOAT_AGENT", &agent))?;
    println!(
        "\nAdd moat to an agent host (it starts moat-mcp over stdio as its user; a user other than root needs `sudo moat setup --user NAME` once, see docs/hosts.md):"
    );
    for client in ["claude-code", "cursor", "vscode"] {
        println!("  {} init --client {client}", server.display());
    }
    for client in ["claude-desktop", "windsurf"] {
        println!("  {} init --client {client} --user", server.display());
    }
    Ok(())
}
