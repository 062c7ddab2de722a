//! `moat-agent`: the daemon inside every moat sandbox.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use moat_agent::{Agent, DEFAULT_VSOCK_PORT, ListenAddr, init};
use tokio::signal::unix::{SignalKind, signal};

/// The moat guest agent: serves process, file, tar and port-forward
/// operations to the host over a Unix socket or vsock.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Where to listen: unix:PATH or vsock:PORT.
    #[arg(long, default_value_t = format!("vsock:{DEFAULT_VSOCK_PORT}"))]
    listen: String,
    /// Act as the sandbox's init: mount /proc, /sys, /dev, /dev/pts,
    /// /dev/shm, /tmp and /run, set the hostname, bring up loopback.
    #[arg(long)]
    init: bool,
    /// Hostname to set with --init.
    #[arg(long)]
    hostname: Option<String>,
    /// Log filter (error, warn, info, debug, trace), to stderr.
    #[arg(long, env = "MOAT_LOG_LEVEL", default_value = "info")]
    log_level: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let listen: ListenAddr = match args.listen.parse() {
        Ok(addr) => addr,
        Err(e) => {
            eprintln!("moat-agent: --listen: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&args.log_level).unwrap_or_default())
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("moat-agent: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(args, listen))
}

async fn run(args: Args, listen: ListenAddr) -> ExitCode {
    let pid1 = std::process::id() == 1;
    if args.init {
        init::setup(args.hostname.as_deref());
    }
    let agent = match Agent::new(pid1) {
        Ok(agent) => agent,
        Err(e) => {
            eprintln!("moat-agent: cannot become a subreaper and watch SIGCHLD: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        eprintln!("moat-agent: cannot install signal handlers");
        return ExitCode::FAILURE;
    };
    let serving = agent.clone().serve(&listen);
    tokio::pin!(serving);
    let code = tokio::select! {
        result = &mut serving => {
            let e = result.err().map_or_else(|| "listener closed".to_owned(), |e| e.to_string());
            eprintln!("moat-agent: {e}");
            if pid1 {
                // An init that exits panics the kernel; stay up so the
                // console keeps the reason, until told to stop.
                let _ = term.recv().await;
            }
            ExitCode::FAILURE
        }
        _ = term.recv() => ExitCode::SUCCESS,
        _ = int.recv() => ExitCode::SUCCESS,
    };
    tracing::info!("shutting down");
    init::stop_children(agent.reaper(), Duration::from_secs(2), pid1).await;
    if let ListenAddr::Unix(path) = &listen {
        let _ = std::fs::remove_file(path);
    }
    if pid1 {
        nix::unistd::sync();
        // In a microVM this powers the machine off; in a pid namespace the
        // kernel ends the namespace instead. Either way nothing follows.
        let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    }
    code
}
