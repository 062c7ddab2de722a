//! `moat-agent`: the daemon inside every moat sandbox.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use moat_agent::boot::{self, BootConfig};
use moat_agent::{Agent, DEFAULT_VSOCK_PORT, ListenAddr, Listener, init};
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
    /// /dev/shm, /tmp and /run, set the hostname, bring up loopback. With
    /// `moat.root=DEVICE` on the kernel command line (a microVM), first load
    /// the initramfs's modules, mount DEVICE and switch root to it.
    #[arg(long)]
    init: bool,
    /// Hostname to set with --init.
    #[arg(long)]
    hostname: Option<String>,
    /// Log filter (error, warn, info, debug, trace), to stderr.
    #[arg(long, env = "MOAT_LOG_LEVEL", default_value = "info")]
    log_level: String,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Set up a jail sandbox and monitor it (used by moat's jail backend).
    Jail(JailArgs),
    /// Rootless: remove sandbox cgroups with the rights of the user's
    /// subordinate ids (used by moat's jail backend when its own removal
    /// is refused; see moat_agent::cgroup_sweep).
    #[command(hide = true)]
    CgroupSweep(SweepArgs),
}

#[derive(Debug, clap::Args)]
struct SweepArgs {
    /// Host uid of sandbox uid 0: the start of the user's subordinate uids.
    #[arg(long)]
    id_base: u32,
    #[arg(long, default_value_t = 65536)]
    id_count: u32,
    /// Host gid of sandbox gid 0: the start of the user's subordinate gids.
    #[arg(long)]
    gid_base: u32,
    /// The socket of the user's namespace holder, joined if one serves.
    #[arg(long)]
    userns_holder: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 60)]
    userns_hold_secs: u64,
    /// The sandbox cgroups to remove (`…/moat/…/sbx-…`).
    #[arg(required = true)]
    dirs: Vec<std::path::PathBuf>,
}

#[derive(Debug, clap::Args)]
struct JailArgs {
    /// The image's rootfs/ directory (the overlay's lower layer).
    #[arg(long)]
    rootfs: std::path::PathBuf,
    /// The sandbox's state directory.
    #[arg(long)]
    state: std::path::PathBuf,
    /// The agent binary to run inside.
    #[arg(long)]
    agent: std::path::PathBuf,
    #[arg(long)]
    hostname: String,
    /// Host uid/gid of sandbox id 0.
    #[arg(long)]
    id_base: u32,
    #[arg(long, default_value_t = 65536)]
    id_count: u32,
    /// Host uid/gid the image's files are owned from, where it is not
    /// --id-base (as root): the root is shown shifted through an idmapped
    /// mount.
    #[arg(long, conflicts_with = "rootless")]
    image_id_base: Option<u32>,
    /// Bound of what the sandbox writes to its root, in MiB.
    #[arg(long)]
    disk_mib: u64,
    /// A cgroup.procs file to join (repeatable).
    #[arg(long)]
    cgroup: Vec<std::path::PathBuf>,
    /// Also read cgroup.procs paths from stdin, one a line, until an empty line.
    #[arg(long)]
    cgroups_on_stdin: bool,
    /// Write `ready` to stdout once the sandbox's socket takes connections.
    #[arg(long)]
    ready_on_stdout: bool,
    /// Network policy open: attach this pasta binary to the sandbox's network.
    #[arg(long)]
    pasta: Option<std::path::PathBuf>,
    /// Run as an unprivileged user: --id-base and --gid-base are its
    /// subordinate ranges, mapped with newuidmap and newgidmap.
    #[arg(long, requires = "gid_base")]
    rootless: bool,
    /// Host gid of sandbox gid 0 (rootless; as root it is --id-base).
    #[arg(long)]
    gid_base: Option<u32>,
    /// Rootless: the socket of the user's namespace holder, joined if one
    /// serves there and started there otherwise.
    #[arg(long, requires = "rootless")]
    userns_holder: Option<std::path::PathBuf>,
    /// Rootless: seconds a holder this monitor starts waits for a request.
    #[arg(long, default_value_t = 60)]
    userns_hold_secs: u64,
    /// Where this monitor's errors go (a spare's stderr is not its log).
    #[arg(long)]
    log: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    moat_sys::fds::keep_inherited_descriptors_to_this_process();
    // The agent's own re-execution into a command cgroup (not for people,
    // so not in --help): see moat_agent::launcher.
    if std::env::args_os().nth(1).is_some_and(|a| a == moat_agent::launcher::SUBCOMMAND) {
        return ExitCode::from(u8::try_from(moat_agent::launcher::run()).unwrap_or(1));
    }
    // A monitor started ahead of its jail (not for people, so not in
    // --help): its arguments come on stdin (see moat_core's jail backend).
    if std::env::args_os().nth(1).is_some_and(|a| a == SPARE_SUBCOMMAND) {
        return spare_jail();
    }
    let args = Args::parse();
    match &args.command {
        Some(Command::Jail(jail)) => return run_jail(jail),
        Some(Command::CgroupSweep(sweep)) => return run_sweep(sweep),
        None => {}
    }
    let mut listen: ListenAddr = match args.listen.parse() {
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
    let mut hostname = args.hostname.clone();
    // The kernel starts /init with no arguments; a jail's PID 1 gets some.
    let init_mode = args.init || (std::process::id() == 1 && std::env::args_os().len() == 1);
    if init_mode {
        init::mount_basics();
        let config = BootConfig::from_cmdline(&std::fs::read_to_string("/proc/cmdline").unwrap_or_default());
        if config.is_vm_boot() {
            if let Err(e) = boot_vm(&config) {
                boot::stage(&format!("boot failed: {e}"));
                return halt();
            }
            hostname = hostname.or(config.hostname.clone());
            if let Some(port) = config.port {
                listen = ListenAddr::Vsock(port);
            }
            // Limits the agent's commands cannot take from it: recovery
            // from a fork or memory bomb, as in a jail.
            if let Err(e) = moat_agent::cgroup::setup_guest() {
                boot::stage(&format!("commands run without their own cgroups: {e}"));
            }
        }
        init::setup(hostname.as_deref());
    }
    // A jail's agent (handed its socket as a descriptor) is moat's side of
    // the sandbox: sandbox processes of its uid may not ptrace it or read
    // its memory. (What it runs is dumpable again once it execs.)
    if matches!(listen, ListenAddr::Fd(_))
        && let Err(e) = nix::sys::prctl::set_dumpable(false)
    {
        eprintln!("moat-agent: cannot make itself non-dumpable: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::from(serve(init_mode, listen))
}

/// A jail's agent, run by the sandbox's init in place of an exec of this
/// program (`moat_agent::jail::JailSpec::serve`): what `--listen fd:N`
/// would run, but for the log, which goes nowhere in a jail.
fn serve_jail(fd: i32) -> u8 {
    serve(false, ListenAddr::Fd(fd))
}

/// Serves on `listen` until told to stop; returns the exit status.
fn serve(init_mode: bool, listen: ListenAddr) -> u8 {
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("moat-agent: cannot start the async runtime: {e}");
            return 1;
        }
    };
    runtime.block_on(run(init_mode, listen))
}

/// The agent's subcommand of a monitor started ahead of its jail (the
/// host's `SPARE_SUBCOMMAND`).
const SPARE_SUBCOMMAND: &str = "jail-spare";

/// A spare monitor: waits for its arguments (a count, then each argument,
/// each ended by a NUL) on stdin, then is the monitor they describe. The
/// end of stdin first (its host went away, or kept it unused) ends it.
fn spare_jail() -> ExitCode {
    use std::io::BufRead;
    use std::os::unix::ffi::OsStringExt;
    // Read through stdin's shared buffer, whose lock is let go before the
    // monitor reads its cgroups from it.
    let argv = {
        let mut input = std::io::stdin().lock();
        let mut field = || -> Option<Vec<u8>> {
            let mut bytes = Vec::new();
            match input.read_until(0, &mut bytes) {
                Ok(n) if n > 0 && bytes.last() == Some(&0) => {
                    bytes.pop();
                    Some(bytes)
                }
                _ => None,
            }
        };
        let Some(count) = field().and_then(|c| String::from_utf8(c).ok()?.parse::<usize>().ok()) else {
            return ExitCode::SUCCESS;
        };
        let mut argv = vec![std::ffi::OsString::from("moat-agent")];
        for _ in 0..count.min(4096) {
            let Some(arg) = field() else { return ExitCode::SUCCESS };
            argv.push(std::ffi::OsString::from_vec(arg));
        }
        argv
    };
    match Args::try_parse_from(argv) {
        Ok(Args { command: Some(Command::Jail(jail)), .. }) => run_jail(&jail),
        Ok(_) => ExitCode::from(2),
        Err(e) => {
            eprintln!("moat-agent jail-spare: {e}");
            ExitCode::from(2)
        }
    }
}

/// The jail monitor: set up the sandbox, then wait for its PID 1.
fn run_jail(args: &JailArgs) -> ExitCode {
    if let Some(log) = &args.log {
        // The log moat made in the state directory: opened without
        // following a link, and made this process's stderr.
        let flags = nix::fcntl::OFlag::O_WRONLY | nix::fcntl::OFlag::O_APPEND | nix::fcntl::OFlag::O_NOFOLLOW;
        match nix::fcntl::open(log, flags, nix::sys::stat::Mode::empty()) {
            Ok(fd) => {
                if nix::unistd::dup2_stderr(&fd).is_err() {
                    return ExitCode::from(1);
                }
            }
            Err(_) => return ExitCode::from(1),
        }
    }
    let spec = moat_agent::jail::JailSpec {
        rootfs: args.rootfs.clone(),
        state: args.state.clone(),
        agent: args.agent.clone(),
        hostname: args.hostname.clone(),
        id_base: args.id_base,
        id_count: args.id_count,
        image_id_base: args.image_id_base,
        disk_mib: args.disk_mib,
        cgroups: args.cgroup.clone(),
        cgroups_on_stdin: args.cgroups_on_stdin,
        ready_on_stdout: args.ready_on_stdout,
        pasta: args.pasta.clone(),
        rootless: args.rootless.then(|| moat_agent::jail::Rootless {
            gid_base: args.gid_base.unwrap_or(args.id_base),
            holder: args.userns_holder.clone(),
            hold: std::time::Duration::from_secs(args.userns_hold_secs),
        }),
        serve: Some(serve_jail),
    };
    match moat_agent::jail::run(&spec) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!(
                "moat-agent jail: {e}: {}",
                std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default()
            );
            ExitCode::from(1)
        }
    }
}

/// Removes sandbox cgroups as the user's subordinate ids (single-threaded:
/// it enters a user namespace).
fn run_sweep(args: &SweepArgs) -> ExitCode {
    let sweep = moat_agent::cgroup_sweep::Sweep {
        id_base: args.id_base,
        id_count: args.id_count,
        rootless: moat_agent::jail::Rootless {
            gid_base: args.gid_base,
            holder: args.userns_holder.clone(),
            hold: Duration::from_secs(args.userns_hold_secs),
        },
        dirs: args.dirs.clone(),
    };
    match moat_agent::cgroup_sweep::run(&sweep) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("moat-agent cgroup-sweep: {e}");
            ExitCode::from(1)
        }
    }
}

/// Modules, root device, switch root, the network (when the command line
/// gives one): each stage reported on the console.
fn boot_vm(config: &BootConfig) -> Result<(), boot::BootError> {
    boot::stage("starting");
    let count = boot::load_modules()?;
    boot::stage(&format!("modules loaded ({count})"));
    let device = config.root.clone().unwrap_or_default();
    boot::wait_for_device(&device, Duration::from_secs(10))?;
    boot::switch_root(config)?;
    boot::stage(&format!("root mounted ({})", device.display()));
    if let Some(net) = &config.net {
        let net = moat_agent::netconf::NetConfig::parse(net).ok_or_else(|| boot::BootError::BadNet(net.clone()))?;
        moat_agent::netconf::configure(&net)?;
        boot::stage(&format!("network up ({} {}/{})", moat_agent::netconf::INTERFACE, net.address, net.prefix));
    }
    Ok(())
}

/// A failed boot: PID 1 must not exit (the kernel would panic and the
/// console line would scroll away), so power off.
fn halt() -> ExitCode {
    nix::unistd::sync();
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    ExitCode::FAILURE
}

async fn run(init_mode: bool, listen: ListenAddr) -> u8 {
    let pid1 = std::process::id() == 1;
    let agent = match Agent::new(pid1) {
        Ok(agent) => agent,
        Err(e) => {
            eprintln!("moat-agent: cannot become a subreaper and watch SIGCHLD: {e}");
            return 1;
        }
    };
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        eprintln!("moat-agent: cannot install signal handlers");
        return 1;
    };
    let code = match Listener::bind(&listen) {
        Ok(listener) => {
            if init_mode {
                boot::stage("ready");
                let timer = std::fs::read_to_string("/proc/cmdline")
                    .ok()
                    .and_then(|cmdline| boot::BootConfig::from_cmdline(&cmdline).boot_timer);
                if let Some(addr) = timer
                    && let Err(e) = boot::signal_boot_timer(addr)
                {
                    eprintln!("moat-agent: cannot signal the boot timer at {addr:#x}: {e}");
                }
            }
            tracing::info!(?listen, "listening");
            // The accept loop on a worker, not this thread (which only
            // waits for signals): a connection then starts on the worker
            // that saw it, with no thread woken in between.
            let serving = tokio::spawn(agent.clone().serve(listener));
            tokio::select! {
                result = serving => {
                    let e = match result {
                        Ok(result) => result.err().map_or_else(|| "listener closed".to_owned(), |e| e.to_string()),
                        Err(e) => format!("the accept loop failed: {e}"),
                    };
                    eprintln!("moat-agent: {e}");
                    1
                }
                _ = term.recv() => 0,
                _ = int.recv() => 0,
            }
        }
        Err(e) => {
            boot::stage(&e.to_string());
            if pid1 {
                // Stay up, so the console keeps the reason, until told to stop.
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            1
        }
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
