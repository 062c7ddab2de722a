//! `moat-mcp`: the MCP server, over stdio.

use std::process::ExitCode;

use moat_core::{Moat, MoatConfig};
use moat_mcp::{MoatServer, ServerConfig};
use rmcp::ServiceExt;

fn main() -> ExitCode {
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
