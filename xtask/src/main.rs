//! `cargo xtask`: moat's developer tasks.
//!
//! Everything a newcomer or CI needs goes through here, so that a fresh
//! machine needs nothing but Rust and (as root) apt.

#![allow(clippy::print_stdout)]

mod build;
mod demo;
mod host;
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
    /// Benchmarks, with ratios against baselines measured in the same run.
    Bench,
    /// Show moat working end to end.
    Demo,
}

fn main() -> ExitCode {
    let result = match Cli::parse().task {
        Task::Build => build::build_all(),
        Task::Test => test::gate(),
        Task::Bench => test::bench(),
        Task::Demo => demo::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}
