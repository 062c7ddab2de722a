//! `cargo xtask`: moat's developer tasks.
//!
//! Everything a newcomer or CI needs goes through here, so that a fresh
//! machine needs nothing but Rust and (as root) apt.

#![allow(clippy::print_stdout)]

mod build;
mod demo;
mod dist;
mod host;
mod image;
mod load;
mod nested;
mod test;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "moat's developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Build every binary (release; the agent static) and print where each is.
    Build,
    /// The whole gate: host packages, fmt check, clippy -D warnings, all tests.
    Test,
    /// Benchmarks, with ratios against baselines measured in the same run;
    /// `bench load` puts many MCP sessions on one server.
    Bench {
        #[command(subcommand)]
        kind: Option<BenchKind>,
    },
    /// Show moat working end to end.
    Demo,
    /// Build the Debian package (target/dist/moat_VERSION_amd64.deb).
    Dist(dist::DistArgs),
    /// Build (or verify) a sandbox image under the data directory.
    Image {
        /// Image name: `default` is what users get.
        #[arg(long, default_value = "default")]
        name: String,
        /// Rebuild everything even when the image is up to date.
        #[arg(long)]
        force: bool,
    },
    /// The nested test host: level 1 under QEMU TCG, with KVM for level-2 microVMs.
    Nested {
        #[command(subcommand)]
        command: nested::Command,
    },
}

#[derive(Debug, Subcommand)]
enum BenchKind {
    /// Many MCP sessions at once over streamable HTTP (Python SDK): latency
    /// per call, errors, server RSS and descriptors, leftovers.
    Load(load::LoadArgs),
}

fn main() -> ExitCode {
    // Debian's depmod, mkfs.ext4 and friends live in sbin, which a non-login
    // root shell may not have on PATH.
    let path = std::env::var("PATH").unwrap_or_default();
    if !path.split(':').any(|p| p == "/usr/sbin") {
        // SAFETY: no other thread exists yet to read the environment.
        unsafe { std::env::set_var("PATH", format!("{path}:/usr/local/sbin:/usr/sbin:/sbin")) };
    }
    let result = match Cli::parse().task {
        Task::Build => build::build_all(),
        Task::Test => test::gate(),
        Task::Bench { kind: None } => test::bench(),
        Task::Bench { kind: Some(BenchKind::Load(args)) } => load::bench_load(&args),
        Task::Demo => demo::run_demo(),
        Task::Dist(args) => dist::dist(&args).map(|_| ()),
        Task::Image { name, force } => image::build(&name, force).map(|_| ()),
        // It exits with the status of the command run in level 1.
        Task::Nested { command } => return nested::main(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}
