//! `moat`: the command line for people.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use moat_core::{BackendKind, HostVirtualization};

/// Disposable, isolated Linux machines for AI agents.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check this host: hardware virtualization, and which backend `auto` picks.
    Doctor,
}

#[allow(clippy::print_stdout)]
fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Doctor => {
            let host = HostVirtualization::probe();
            let kvm = match &host.kvm_problem {
                None => "usable".to_owned(),
                Some(problem) => format!("not usable: {problem}"),
            };
            println!("/dev/kvm:                    {kvm}");
            println!(
                "hardware virtualization:     {}",
                host.cpu_flag.map_or_else(|| "no (no vmx/svm flag)".to_owned(), |f| format!("yes ({f})"))
            );
            let choice = host.choose(BackendKind::Auto);
            println!("backend auto uses:           {} ({})", choice.kind, choice.reason);
            ExitCode::SUCCESS
        }
    }
}
