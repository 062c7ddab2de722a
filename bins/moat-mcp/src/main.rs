//! `moat-mcp`: the MCP server, over stdio.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use moat_core::{Moat, MoatConfig};
use moat_mcp::hosts::{Host, Scope};
use moat_mcp::{MoatServer, ServerConfig};
use rmcp::ServiceExt;

/// moat's MCP server: disposable, isolated Linux sandboxes for AI agents.
/// Without a command it serves MCP over stdio (what agent hosts start).
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// Serve streamable HTTP instead of stdio (not in this build yet).
    #[arg(long)]
    http: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Add moat to an agent host's MCP configuration, keeping its other entries.
    Init {
        /// claude-code, claude-desktop, cursor, vscode or windsurf.
        #[arg(long)]
        client: Host,
        /// The project's configuration (in the current directory); the default.
        #[arg(long, conflicts_with = "user")]
        project: bool,
        /// The user's configuration.
        #[arg(long)]
        user: bool,
        /// Print the merged configuration instead of writing it.
        #[arg(long)]
        print: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.http {
        eprintln!(
            "moat-mcp: --http: streamable HTTP is not part of this build yet; agent hosts can start moat-mcp over stdio"
        );
        return ExitCode::from(2);
    }
    if let Some(Command::Init { client, user, print, .. }) = cli.command {
        return init(client, if user { Scope::User } else { Scope::Project }, print);
    }
    let config = match ServerConfig::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("moat-mcp: {e}");
            return ExitCode::from(2);
        }
    };
    // stdout belongs to the MCP transport: logs go to stderr only.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MOAT_LOG_LEVEL").unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Some(arg) = std::env::args().nth(1) {
        eprintln!(
            "moat-mcp: unknown argument {arg:?}; this build serves MCP over stdio only (streamable HTTP is not part of it yet)"
        );
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("moat-mcp: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(serve(config))
}

async fn serve(config: ServerConfig) -> ExitCode {
    let moat = match MoatConfig::from_env() {
        Ok(moat_config) => {
            let moat_config = MoatConfig {
                backend: config.backend,
                max_sandboxes: config.max_sandboxes,
                pool_size: config.pool_size,
                pool_spec: config.defaults.clone(),
                ..moat_config
            };
            Moat::new(moat_config).await
        }
        Err(e) => Err(e),
    };
    let moat = match moat {
        Ok(moat) => moat,
        Err(e) => {
            eprintln!("moat-mcp: {e}");
            return ExitCode::FAILURE;
        }
    };
    let server = match MoatServer::new(moat.clone(), config.defaults.clone()) {
        Ok(server) => server,
        Err(e) => {
            eprintln!("moat-mcp: the built-in tools contract does not parse: {e}");
            return ExitCode::FAILURE;
        }
    };
    let running = match server.serve(rmcp::transport::stdio()).await {
        Ok(running) => running,
        Err(e) => {
            eprintln!("moat-mcp: the MCP session did not start: {e}");
            moat.destroy_all().await;
            return ExitCode::FAILURE;
        }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let code = tokio::select! {
        // stdin closed: the host went away.
        result = running.waiting() => if result.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE },
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => ExitCode::SUCCESS,
    };
    // Every sandbox this process owns goes with it.
    moat.destroy_all().await;
    code
}

/// Writes (or with `print`, shows) the host's configuration with moat in it.
#[allow(clippy::print_stdout)]
fn init(client: Host, scope: Scope, print: bool) -> ExitCode {
    let fail = |why: String| {
        eprintln!("moat-mcp init: {why}");
        ExitCode::FAILURE
    };
    let (Ok(project), Some(home)) = (std::env::current_dir(), std::env::var_os("HOME")) else {
        return fail("cannot tell the current directory or $HOME".into());
    };
    let path = match client.config_path(scope, &project, std::path::Path::new(&home)) {
        Ok(path) => path,
        Err(e) => return fail(e),
    };
    let command = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return fail(format!("cannot tell where moat-mcp is: {e}")),
    };
    let existing = std::fs::read_to_string(&path).ok();
    let (text, replaced) = match moat_mcp::hosts::merge(client, existing.as_deref(), &command) {
        Ok(merged) => merged,
        Err(e) => return fail(format!("{}: {e}", path.display())),
    };
    if print {
        print!("{text}");
        return ExitCode::SUCCESS;
    }
    if let Some(dir) = path.parent()
        && let Err(e) = std::fs::create_dir_all(dir)
    {
        return fail(format!("cannot create {}: {e}", dir.display()));
    }
    // Written beside it and renamed: a failure leaves the old file whole.
    let temp = path.with_extension("moat-tmp");
    if let Err(e) = std::fs::write(&temp, &text).and_then(|()| std::fs::rename(&temp, &path)) {
        let _ = std::fs::remove_file(&temp);
        return fail(format!("cannot write {}: {e}", path.display()));
    }
    let verb = if replaced { "updated the moat entry in" } else { "added moat to" };
    println!("{verb} {} (command: {})", path.display(), command.display());
    ExitCode::SUCCESS
}
