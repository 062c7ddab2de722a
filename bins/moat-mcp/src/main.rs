//! `moat-mcp`: the MCP server, over stdio or streamable HTTP.

use std::os::unix::fs::OpenOptionsExt;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use moat_core::log::LogLevel;
use moat_core::{Moat, MoatConfig};
use moat_mcp::hosts::{Host, Scope};
use moat_mcp::http::{HttpConfig, HttpServer, TokenFile, parse_host};
use moat_mcp::{MoatServer, ServerConfig};
use rmcp::ServiceExt;

/// moat's MCP server: disposable, isolated Linux sandboxes for AI agents.
/// Without a command it serves MCP over stdio (what agent hosts start).
/// Configuration comes from MOAT_* environment variables (docs/operations.md).
#[derive(Debug, Parser)]
#[command(name = "moat-mcp", version)]
struct Cli {
    /// Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio.
    /// Every request needs `Authorization: Bearer <token>`: MOAT_HTTP_TOKEN,
    /// or else a token generated at start into a file only you can read
    /// (its path is printed on stderr).
    #[arg(long)]
    http: bool,
    /// The address to listen on with --http: one address, not a wildcard.
    #[arg(long, default_value = "127.0.0.1", requires = "http")]
    host: String,
    /// The port to listen on with --http (0 picks a free one).
    #[arg(long, default_value_t = 8000, requires = "http")]
    port: u16,
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

/// What the operator grants models, as `--help` shows it.
fn grants_help() -> String {
    match ServerConfig::from_env() {
        Ok(config) => format!(
            "Grants in force (what a model may ask for; set by the operator):\n  {}\n  \
             Raise with MOAT_ALLOW_NETWORK=none|filtered|open and MOAT_ALLOW_HOSTS=host,host.",
            config.grants.describe(&config.egress())
        ),
        Err(e) => format!("Grants: the environment is not valid, so the server would not start: {e}"),
    }
}

/// Says a line on stderr (`moat-mcp: …`, what clients and tests read)
/// and logs it to `MOAT_LOG_FILE`, where an operator looks for why the
/// server stopped.
macro_rules! said {
    ($level:ident, $($arg:tt)*) => {{
        let line = format!($($arg)*);
        eprintln!("moat-mcp: {line}");
        tracing::event!(target: moat_core::log::SAID, tracing::Level::$level, "{line}");
    }};
}

fn main() -> ExitCode {
    moat_core::process::keep_inherited_descriptors_to_this_process();
    // `cargo xtask dist` asks each binary for its manual pages, rendered
    // from this very parser (clap_mangen), so they never drift from --help.
    if let Some(dir) = manual_dir() {
        return match clap_mangen::generate_to(Cli::command().after_help(grants_help()), &dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("moat-mcp: cannot write manual pages into {}: {e}", dir.display());
                ExitCode::FAILURE
            }
        };
    }
    let matches = Cli::command().after_help(grants_help()).get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
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
    // stdout belongs to the MCP transport: logs go to stderr (and the
    // log file). rmcp is held at info: its debug records carry every
    // request's arguments, secrets such as git_clone's token included.
    let rmcp = if config.log_level >= LogLevel::Debug { &["rmcp=info"][..] } else { &[] };
    if let Err(e) = moat_core::log::init(config.log_level, rmcp, config.log_file.as_deref()) {
        eprintln!("moat-mcp: {e}");
        return ExitCode::from(2);
    }
    if !config.test_egress_nets.is_empty() || !config.test_resolve.is_empty() {
        tracing::warn!(
            "MOAT_TEST_EGRESS_NETS or MOAT_TEST_RESOLVE is set: filtered sandboxes may reach the addresses they name; \
             these are for tests only"
        );
    }
    if config.test_conformance_tools {
        tracing::warn!(
            "MOAT_TEST_CONFORMANCE_TOOLS is set: --http lists the conformance suite's test_* fixtures beside \
             moat's tools; this is for tests only"
        );
    }
    let http = if cli.http {
        let host = match parse_host(&cli.host) {
            Ok(host) => host,
            Err(e) => {
                said!(ERROR, "{e}");
                return ExitCode::from(2);
            }
        };
        Some((host, cli.port))
    } else {
        None
    };
    raise_descriptor_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            said!(ERROR, "cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(serve(config, http))
}

async fn serve(config: ServerConfig, http: Option<(std::net::IpAddr, u16)>) -> ExitCode {
    // Preview links where clients reach this server: its HTTP address (or
    // MOAT_PREVIEW_URL's host); over stdio, the loopback.
    let reached = http.map_or(std::net::SocketAddr::from(([127, 0, 0, 1], 0)), |(host, port)| (host, port).into());
    let preview = match moat_core::net::preview::PreviewHost::for_http_from_env(reached) {
        Ok(preview) => preview,
        Err(e) => {
            said!(ERROR, "{e}");
            return ExitCode::from(2);
        }
    };
    let moat = match MoatConfig::from_env() {
        Ok(moat_config) => {
            let moat_config = MoatConfig {
                preview,
                backend: config.backend,
                max_sandboxes: config.max_sandboxes,
                pool_size: config.pool_size,
                pool_spec: config.defaults.clone(),
                egress: config.egress(),
                grants: config.grants,
                ..moat_config
            };
            Moat::new(moat_config).await
        }
        Err(e) => Err(e),
    };
    let moat = match moat {
        Ok(moat) => moat,
        // The operator's settings are wrong: a usage error, as for flags.
        Err(e @ moat_core::ConfigError::Invalid(_)) => {
            said!(ERROR, "{e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            said!(ERROR, "{e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some((host, port)) = http {
        let code = serve_http(&moat, &config, host, port).await;
        moat.close().await;
        return code;
    }
    let server = match MoatServer::new(moat.clone(), config.defaults.clone()) {
        Ok(server) => server,
        Err(e) => {
            said!(ERROR, "the built-in tools contract does not parse: {e}");
            return ExitCode::FAILURE;
        }
    };
    let running = match server.serve(moat_mcp::stdio::StdioTransport::stdio()).await {
        Ok(running) => running,
        Err(e) => {
            said!(ERROR, "the MCP session did not start: {e}");
            moat.close().await;
            return ExitCode::FAILURE;
        }
    };
    let code = tokio::select! {
        // stdin closed: the host went away.
        result = running.waiting() => if result.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE },
        () = terminated() => ExitCode::SUCCESS,
    };
    // Every sandbox this process owns goes with it.
    moat.close().await;
    code
}

/// Serves streamable HTTP until SIGTERM or SIGINT, with `MOAT_HTTP_TOKEN`
/// or a token generated now into a file only this user can read.
async fn serve_http(moat: &Moat, config: &ServerConfig, host: std::net::IpAddr, port: u16) -> ExitCode {
    let server = match HttpServer::bind(HttpConfig {
        host,
        port,
        token: String::new(),
        fixtures: config.test_conformance_tools,
        sandboxes_per_session: config.sandboxes_per_session,
    })
    .await
    {
        Ok(server) => server,
        Err(e) => {
            said!(ERROR, "{e}");
            return ExitCode::FAILURE;
        }
    };
    let (token, _file) = match &config.http_token {
        Some(token) => (token.clone(), None),
        None => {
            let path = moat_mcp::http::token_path(moat.data_dir(), server.addr().port());
            match TokenFile::create(&path) {
                Ok(file) => {
                    eprintln!(
                        "moat-mcp: MOAT_HTTP_TOKEN is not set: clients must send `Authorization: Bearer <token>` \
                         with the token in {} (readable by this user only; removed when the server stops)",
                        file.path.display()
                    );
                    (file.token.clone(), Some(file))
                }
                Err(e) => {
                    said!(ERROR, "{e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    };
    moat_core::net::preview::never_forward(&token);
    let server = server.with_token(token);
    // The URL on stderr, for people and for scripts that asked for port 0.
    said!(INFO, "serving MCP over streamable HTTP at {}", server.url());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        terminated().await;
        stop.cancel();
    });
    match server.serve(moat.clone(), config.defaults.clone(), shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            said!(ERROR, "{e}");
            ExitCode::FAILURE
        }
    }
}

/// Completes on SIGTERM or SIGINT.
async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
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
    let launch = moat_mcp::hosts::Launch::new(&command, delegating_systemd_run().as_deref());
    let existing = std::fs::read_to_string(&path).ok();
    let (text, replaced) = match moat_mcp::hosts::merge(client, existing.as_deref(), &launch) {
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
    // A new file of a name no one could foresee, never through a link: in
    // a directory others write in, a name planted there would be followed
    // (or renamed into the configuration's place).
    let temp = path.with_extension(format!("moat-tmp-{}-{}", std::process::id(), nanos_now()));
    // A configuration the user had closed (other servers' keys in it)
    // stays as closed.
    let mode = std::fs::metadata(&path)
        .map_or(0o666, |meta| std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(&temp)
        .and_then(|mut file| std::io::Write::write_all(&mut file, text.as_bytes()));
    if let Err(e) = written.and_then(|()| std::fs::rename(&temp, &path)) {
        let _ = std::fs::remove_file(&temp);
        return fail(format!("cannot write {}: {e}", path.display()));
    }
    let verb = if replaced { "updated the moat entry in" } else { "added moat to" };
    println!("{verb} {} (command: {})", path.display(), launch.describe());
    let token_dir = moat_mcp::http::token_dir(&moat_core::image::data_dir());
    println!("{}", moat_mcp::hosts::http_token_help(&token_dir));
    ExitCode::SUCCESS
}

/// systemd-run, where a user's moat-mcp must start through it: on a
/// cgroup v2 host, as a user other than root, with a systemd user manager
/// (`$XDG_RUNTIME_DIR/systemd`) to make the delegated scope. Elsewhere
/// (root, cgroup v1, no systemd) moat-mcp starts as it is.
fn delegating_systemd_run() -> Option<std::path::PathBuf> {
    let v2 = moat_core::cgroup::CgroupSupport::probe() == moat_core::cgroup::CgroupSupport::V2;
    let user = moat_core::hostuser::HostUser::current();
    let manager = std::env::var_os("XDG_RUNTIME_DIR")
        .map_or_else(|| std::path::PathBuf::from(format!("/run/user/{}", user.uid)), std::path::PathBuf::from)
        .join("systemd");
    (v2 && !user.is_root() && manager.is_dir()).then(|| moat_core::programs::find_program("systemd-run")).flatten()
}

/// The directory of `NAME --write-manual DIR`, a hidden option of the
/// package build.
fn manual_dir() -> Option<std::path::PathBuf> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    match &args[..] {
        [flag, dir] if flag == "--write-manual" => Some(dir.into()),
        _ => None,
    }
}

/// Raises this process's soft limit of open descriptors to its hard limit:
/// every sandbox, agent connection, preview link and HTTP session holds
/// some, and the usual soft limit (1024) is a few dozen busy sandboxes.
/// The hard limit stays the operator's (`ulimit -Hn`, systemd's
/// `LimitNOFILE`).
fn raise_descriptor_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!("cannot raise the open-descriptor limit from {soft} to {hard}: {e}");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot read the open-descriptor limit: {e}"),
    }
}

/// Nanoseconds of the clock, for a name no one could foresee.
fn nanos_now() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}
