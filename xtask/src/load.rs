//! `cargo xtask bench load`: many MCP sessions at once on `moat-mcp --http`.
//!
//! Builds `moat-mcp` (release) and hands it to `bench_load.py`, which
//! drives it through the official Python SDK over streamable HTTP and
//! reports latencies, errors, the server's RSS and descriptors, and
//! leftovers (see that script's docstring and docs/benchmarks.md).
//!
//! The sandboxes are jails of the `default` image; the image is used as it
//! stands (`cargo xtask image` builds it), not rebuilt, so that the bench
//! never changes what other runs on this host use.

use std::process::Command;

use anyhow::{Context, Result};
use clap::Args;

use crate::host::{BASE_PACKAGES, cargo, ensure_packages, root, run};
use crate::{build, test};

/// What `cargo xtask bench load` takes.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Good sessions at once, each with its own sandbox.
    #[arg(long, default_value_t = 100)]
    sessions: u32,
    /// Calls each good session makes (per phase), the kinds in turn:
    /// command, 50 KB write_file, read_file back, output flood, Python.
    #[arg(long, default_value_t = 20)]
    calls: u32,
    /// Misbehaving sessions in a second phase (fork bomb, output flood,
    /// memory bomb, disconnect mid-call, in turn); the good sessions'
    /// p99 is compared with their first phase, alone.
    #[arg(long, default_value_t = 0)]
    bad: u32,
    /// Which misdeeds the bad sessions take in turn, comma-separated
    /// (default all: `fork bomb,output flood,memory bomb,disconnect mid-call`).
    #[arg(long)]
    bad_kinds: Option<String>,
    /// Sessions that come and go at a steady rate for `--minutes`, with
    /// RSS and descriptors printed each minute.
    #[arg(long)]
    soak: bool,
    /// How long a soak runs.
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Calls per second in a soak, all sessions together.
    #[arg(long, default_value_t = 5.0)]
    rate: f64,
}

pub fn bench_load(args: &LoadArgs) -> Result<()> {
    ensure_packages(BASE_PACKAGES)?;
    let data = moat_core::image::data_dir();
    moat_core::image::Image::open(&data, "default").with_context(|| {
        format!("the load bench needs the default image under {}: run `cargo xtask image`", data.display())
    })?;
    // A static agent given by the caller is used as it is.
    let agent = match std::env::var_os("MOAT_AGENT") {
        Some(agent) => agent.into(),
        None => build::static_agent()?,
    };
    run(cargo().args(["build", "--release", "--bin", "moat-mcp"]))?;
    let pythons = test::mcp_sdks()?;
    let python = pythons.split(':').next_back().context("no Python MCP SDK")?.to_owned();
    let out = root().join("target/bench-load");
    let _ = std::fs::remove_dir_all(&out);
    let mut command = Command::new(python);
    command
        // Unbuffered: a soak prints a line a minute.
        .arg("-u")
        .arg(root().join("xtask/src/bench_load.py"))
        .arg(root().join("target/release/moat-mcp"))
        .arg(&out)
        .arg("--images")
        .arg(data.join("images"))
        .args(["--sessions", &args.sessions.to_string(), "--calls", &args.calls.to_string()])
        .args(["--bad", &args.bad.to_string(), "--minutes", &args.minutes.to_string()])
        .args(["--rate", &args.rate.to_string()])
        .env("MOAT_AGENT", &agent);
    if let Some(kinds) = &args.bad_kinds {
        command.args(["--bad-kinds", kinds]);
    }
    if args.soak {
        command.arg("--soak");
    }
    run(&mut command)
}
