//! `moat`: the command line for people.

#![allow(clippy::print_stdout)]

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use moat_core::cgroup::CgroupSupport;
use moat_core::{BackendKind, HostVirtualization, Image, Moat, MoatConfig, NetworkPolicy, SandboxSpec};
use moat_proto::{ExecRequest, WinSize};

mod fix;
mod setup;

/// Disposable, isolated Linux machines for AI agents.
///
/// Every sandbox lives as long as the command that made it: `moat run`
/// creates one, runs a command in it and destroys it.
#[derive(Debug, Parser)]
#[command(name = "moat", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Args)]
struct SandboxArgs {
    /// Image to boot (built with `moat image build --name NAME`).
    #[arg(long, default_value = "default")]
    image: String,
    /// Isolation backend: auto, vm or jail.
    #[arg(long, default_value = "auto")]
    backend: BackendKind,
    /// Network policy: none (loopback only), filtered or open.
    #[arg(long, default_value = "none")]
    network: NetworkPolicy,
    /// CPUs the sandbox may use.
    #[arg(long, default_value_t = 1)]
    cpus: u32,
    /// Memory limit in MiB.
    #[arg(long = "memory", default_value_t = 1024)]
    memory_mib: u64,
    /// Disk (writes to the root file system) limit in MiB.
    #[arg(long = "disk", default_value_t = 2048)]
    disk_mib: u64,
}

#[derive(Debug, Subcommand)]
enum ImageCommand {
    /// Build the image from Debian's archive around this installation's
    /// agent, or verify it when it is up to date. As root with mmdebstrap's
    /// root mode; as any other user with its unshare mode, the files owned
    /// by the user's subordinate ids (`moat setup --user` gives a range).
    Build {
        /// Image name: `default` is what sandboxes get.
        #[arg(long, default_value = "default")]
        name: String,
        /// Rebuild everything even when the image is up to date.
        #[arg(long)]
        force: bool,
    },
    /// Remove an image from the data directory (a rootless build's files
    /// included, which only moat can delete). Remove its sandboxes first.
    Rm {
        /// Image name.
        #[arg(long)]
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a command in a fresh sandbox, streaming its output; exits with its exit code. Piped or
    /// redirected input goes to the command; a terminal's does not (use `moat shell`).
    Run {
        #[command(flatten)]
        sandbox: SandboxArgs,
        /// The command and its arguments (after `--`).
        #[arg(required = true, trailing_var_arg = true)]
        cmd: Vec<String>,
    },
    /// Open an interactive shell in a fresh sandbox.
    Shell {
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// List live sandboxes (of every moat process on this host).
    Ls,
    /// Remove sandboxes by id, or all of them.
    Rm {
        ids: Vec<String>,
        #[arg(long)]
        all: bool,
    },
    /// List retained task records, or remove them.
    Tasks {
        /// Remove these task records (patch and log included).
        #[arg(long = "rm", value_name = "TASK_ID")]
        remove: Vec<String>,
    },
    /// Check this host: virtualization, namespaces, cgroups, the image, the backend.
    Doctor {
        /// The image to check (and, with --fix, to build when missing).
        #[arg(long, default_value = "default")]
        image: String,
        /// First install what is missing: the host packages moat uses (as
        /// root, with apt-get), /dev/net/tun's mode, and the image when
        /// there is none; says what it did, or what to run where it cannot.
        #[arg(long)]
        fix: bool,
    },
    /// Sandbox images.
    Image {
        #[command(subcommand)]
        command: ImageCommand,
    },
    /// As root, once: tune this host for sandboxes (cgroup moves without a
    /// grace period) and, with --user, prepare a user to run moat without
    /// root (subordinate ids, a delegated cgroup subtree, a copy of the
    /// image in its range).
    Setup {
        /// The user to prepare.
        #[arg(long)]
        user: Option<String>,
        /// The image of root's to copy for the user.
        #[arg(long, default_value = "default")]
        image: String,
    },
}

fn main() -> ExitCode {
    moat_core::process::keep_inherited_descriptors_to_this_process();
    // `cargo xtask dist` asks each binary for its manual pages, rendered
    // from this very parser (clap_mangen), so they never drift from --help.
    if let Some(dir) = manual_dir() {
        return match clap_mangen::generate_to(Cli::command(), &dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("moat: cannot write manual pages into {}: {e}", dir.display());
                ExitCode::FAILURE
            }
        };
    }
    let cli = Cli::parse();
    let logs = moat_core::log::from_env(moat_core::log::LogLevel::Warn)
        .and_then(|(level, file)| moat_core::log::init(level, &[], file.as_deref()));
    if let Err(e) = logs {
        eprintln!("moat: {e}");
        return ExitCode::from(2);
    }
    // One thread: the CLI drives one sandbox (or a listing) at a time, and
    // a pool of workers would cost every short `moat run` their start and
    // the wake-ups between them (inter-processor interrupts, dear in a VM).
    // Blocking work goes to tokio's blocking threads as before.
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("moat: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("moat: {e}");
            let mut source = std::error::Error::source(&*e);
            while let Some(cause) = source {
                eprintln!("  caused by: {cause}");
                source = cause.source();
            }
            ExitCode::FAILURE
        }
    }
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

async fn run(command: Command) -> Result<ExitCode> {
    match command {
        Command::Run { sandbox, cmd } => run_command(sandbox, cmd).await,
        Command::Shell { sandbox } => shell(sandbox).await,
        Command::Ls => ls(),
        Command::Rm { ids, all } => rm(&ids, all),
        Command::Tasks { remove } => tasks(&remove),
        Command::Doctor { image, fix: false } => Ok(doctor(&image)),
        Command::Doctor { image, fix: true } => {
            let fixed = fix::missing(&image);
            println!();
            let report = doctor(&image);
            Ok(if fixed { report } else { ExitCode::FAILURE })
        }
        Command::Image { command: ImageCommand::Build { name, force } } => {
            let agent = moat_core::moat::find_agent()?;
            moat_image::build(&name, force, &agent)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Image { command: ImageCommand::Rm { name } } => {
            let dir = moat_image::remove(&name)?;
            println!("removed image {name:?} ({})", dir.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Setup { user, image } => setup::run(user.as_deref(), &image).map(|()| ExitCode::SUCCESS),
    }
}

async fn start(args: &SandboxArgs) -> Result<(Moat, String)> {
    // The person at the command line is the operator: `--network` is theirs.
    let mut config = MoatConfig::operator_from_env()?;
    config.backend = args.backend;
    let moat = Moat::new(config).await?;
    let spec = SandboxSpec {
        image: args.image.clone(),
        cpus: args.cpus,
        memory_mib: args.memory_mib,
        disk_mib: args.disk_mib,
        network: args.network,
        idle_seconds: 0,
        ..SandboxSpec::default()
    };
    let sandbox = moat.create(spec).await?;
    Ok((moat, sandbox.id))
}

/// Ctrl-C and SIGTERM end the sandbox cleanly instead of the process.
async fn interrupted() {
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else { return };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn run_command(args: SandboxArgs, cmd: Vec<String>) -> Result<ExitCode> {
    let (moat, id) = start(&args).await?;
    // Piped or redirected input goes to the command (`… | moat run -- cat`);
    // a terminal's stays here, as `docker run` without `-i` leaves it
    // (`moat shell` is for typing into a sandbox).
    let piped = !std::io::IsTerminal::is_terminal(&std::io::stdin());
    let result = async {
        let mut request = ExecRequest::argv(cmd);
        request.stdin = piped;
        // The sandbox ends with this command: the agent makes nothing
        // ahead for a next one.
        request.last = true;
        let mut handle = moat.exec(&id, request).await?;
        let mut stdout = handle.take_stdout().ok_or("no stdout")?;
        let mut stderr = handle.take_stderr().ok_or("no stderr")?;
        if let Some(mut stdin) = handle.take_stdin() {
            // Read on a thread of its own, not the runtime's: a writer that
            // never closes the pipe (`sleep 100 | moat run -- true`) must
            // not keep this process from exiting once the command is done.
            let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
            std::thread::spawn(move || {
                let mut input = std::io::stdin().lock();
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n @ 1..) = std::io::Read::read(&mut input, &mut buf) {
                    if tx.blocking_send(bytes::Bytes::copy_from_slice(&buf[..n])).is_err() {
                        return;
                    }
                }
            });
            tokio::spawn(async move {
                while let Some(chunk) = rx.recv().await {
                    if stdin.write(chunk).await.is_err() {
                        return;
                    }
                }
                let _ = stdin.close().await;
            });
        }
        let copy_out = async {
            let mut out = std::io::stdout();
            while let Some(chunk) = stdout.recv().await {
                let _ = out.write_all(&chunk).and_then(|()| out.flush());
            }
        };
        let copy_err = async {
            let mut err = std::io::stderr();
            while let Some(chunk) = stderr.recv().await {
                let _ = err.write_all(&chunk);
            }
        };
        tokio::select! {
            _ = async { tokio::join!(copy_out, copy_err) } => {}
            () = interrupted() => return Ok::<_, Box<dyn std::error::Error>>(ExitCode::from(130)),
        }
        let status = handle.wait().await?;
        Ok(match (status.code, status.signal) {
            (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
            (None, Some(signal)) => ExitCode::from(u8::try_from(128 + signal).unwrap_or(1)),
            _ => ExitCode::FAILURE,
        })
    }
    .await;
    moat.destroy_all().await;
    result
}

async fn shell(args: SandboxArgs) -> Result<ExitCode> {
    use tokio::io::AsyncReadExt;
    let (moat, id) = start(&args).await?;
    let size = terminal_size().unwrap_or(WinSize { rows: 24, cols: 80 });
    let mut req = ExecRequest::argv(["/bin/bash", "-l"]);
    req.pty = Some(size);
    req.stdin = true;
    let result = async {
        let mut handle = moat.exec(&id, req).await?;
        let mut stdin = handle.take_stdin().ok_or("no stdin")?;
        let mut stdout = handle.take_stdout().ok_or("no stdout")?;
        let raw = RawTerminal::enter();
        let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())?;
        let mut input = tokio::io::stdin();
        let mut buf = vec![0u8; 4096];
        let mut out = std::io::stdout();
        loop {
            tokio::select! {
                chunk = stdout.recv() => match chunk {
                    Some(chunk) => { let _ = out.write_all(&chunk).and_then(|()| out.flush()); }
                    None => break,
                },
                n = input.read(&mut buf) => match n {
                    Ok(0) | Err(_) => break,
                    Ok(n) => stdin.write(bytes::Bytes::copy_from_slice(&buf[..n])).await?,
                },
                _ = winch.recv() => {
                    if let Some(size) = terminal_size() {
                        handle.resize(size).await?;
                    }
                }
            }
        }
        drop(raw);
        let status = handle.wait().await?;
        Ok::<_, Box<dyn std::error::Error>>(ExitCode::from(status.code.and_then(|c| u8::try_from(c).ok()).unwrap_or(1)))
    }
    .await;
    moat.destroy_all().await;
    result
}

fn terminal_size() -> Option<WinSize> {
    let mut ws = nix::libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes one `winsize` into the struct we own.
    let rc = unsafe { nix::libc::ioctl(0, nix::libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_row > 0).then_some(WinSize { rows: ws.ws_row, cols: ws.ws_col })
}

/// The local terminal in raw mode (keys, Ctrl-C included, go to the
/// sandbox) until dropped.
struct RawTerminal(Option<nix::sys::termios::Termios>);

impl RawTerminal {
    fn enter() -> Self {
        let stdin = std::io::stdin();
        let Ok(saved) = nix::sys::termios::tcgetattr(&stdin) else { return Self(None) };
        let mut raw = saved.clone();
        nix::sys::termios::cfmakeraw(&mut raw);
        let _ = nix::sys::termios::tcsetattr(&stdin, nix::sys::termios::SetArg::TCSANOW, &raw);
        Self(Some(saved))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(saved) = &self.0 {
            let _ = nix::sys::termios::tcsetattr(std::io::stdin(), nix::sys::termios::SetArg::TCSANOW, saved);
        }
    }
}

fn ls() -> Result<ExitCode> {
    let dir = moat_core::state::sandboxes_dir(&moat_core::image::data_dir());
    moat_core::state::trusted(&dir)?;
    let mut rows = Vec::new();
    for entry in std::fs::read_dir(&dir).into_iter().flatten().filter_map(std::result::Result::ok) {
        let path = entry.path();
        let owner = std::fs::read_to_string(path.join("owner")).unwrap_or_default();
        let created = entry.metadata().and_then(|m| m.modified()).ok();
        let age = created.and_then(|c| c.elapsed().ok()).map_or_else(|| "?".into(), |d| format!("{}s", d.as_secs()));
        rows.push((entry.file_name().to_string_lossy().into_owned(), owner.trim().to_owned(), age));
    }
    if rows.is_empty() {
        println!("no live sandboxes");
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<14} {:>8} {:>8}", "ID", "OWNER", "AGE");
    for (id, owner, age) in rows {
        println!("{id:<14} {owner:>8} {age:>8}");
    }
    Ok(ExitCode::SUCCESS)
}

fn rm(ids: &[String], all: bool) -> Result<ExitCode> {
    let dir = moat_core::state::sandboxes_dir(&moat_core::image::data_dir());
    // Nothing another user could have planted is killed or removed.
    moat_core::state::trusted(&dir)?;
    let targets: Vec<String> = if all {
        std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .filter_map(std::result::Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    } else if ids.is_empty() {
        return Err("give sandbox ids (see `moat ls`) or --all".into());
    } else {
        ids.to_vec()
    };
    let mut code = ExitCode::SUCCESS;
    for id in targets {
        let state = dir.join(&id);
        if state.join("monitor").exists() {
            // The monitor's death takes the sandbox's pid namespace along;
            // its owner notices on its next operation. One that is gone
            // already (its pid maybe another process's now) is left to
            // the sweep below.
            moat_core::state::kill_monitor(&state);
            println!("removed {id}");
        } else {
            eprintln!("moat: no sandbox {id}");
            code = ExitCode::FAILURE;
        }
    }
    // Directories whose owner is gone are swept now.
    let data_dir = moat_core::image::data_dir();
    // Rootless, what sandbox root made in its cgroups needs the sweeper.
    let sweeper = moat_core::moat::find_agent().ok().and_then(|agent| {
        moat_core::backend::jail::sweeper_for(&agent, &moat_core::hostuser::HostUser::current(), &data_dir)
            .ok()
            .flatten()
    });
    moat_core::state::sweep(&data_dir, sweeper.as_ref());
    Ok(code)
}

fn tasks(remove: &[String]) -> Result<ExitCode> {
    let data = moat_core::image::data_dir();
    for id in remove {
        moat_core::task::remove_record(&data, id)?;
        println!("removed {id}");
    }
    if !remove.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    let records = moat_core::task::records(&data);
    if records.is_empty() {
        println!("no task records");
    }
    for r in records {
        println!(
            "{}  {:<7} {} files changed (+{} -{})  from {}\n    patch: {}\n    log:   {}",
            r.task.id,
            format!("{:?}", r.task.runtime).to_lowercase(),
            r.summary.files_changed,
            r.summary.insertions,
            r.summary.deletions,
            r.task.source,
            r.patch_path.display(),
            r.log_path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// What `MOAT_CA_FILE` adds to every new sandbox, or, unset, whether the
/// host trusts CAs the image does not (a TLS-inspecting proxy's), in words.
fn extra_cas(image_root: &Path) -> String {
    use moat_core::trust::{BUNDLE, ExtraCa, LOCAL_CAS, untrusted_by_image};
    match ExtraCa::from_env() {
        Ok(Some(ca)) => format!(
            "{} certificate(s) from {} added to every new sandbox's trust store",
            ca.certificates,
            ca.source.display()
        ),
        Err(e) => format!("{e}; moat and moat-mcp will not start"),
        Ok(None) => match untrusted_by_image(Path::new(BUNDLE), Path::new(LOCAL_CAS), image_root) {
            None => "none (the image's trust store could not be read to compare with the host's)".into(),
            Some(u) if u.count == 0 => "none needed: the image trusts every CA added to this host".into(),
            Some(u) => {
                let files: Vec<String> = u.files.iter().map(|f| f.display().to_string()).collect();
                format!(
                    "none, but {} CA(s) added to this host are not in the image (a TLS-inspecting proxy's?): HTTPS \
                     they sign fails in sandboxes (pip, npm, curl); set MOAT_CA_FILE to a PEM file of the ones \
                     to trust ({})",
                    u.count,
                    files.join(", ")
                )
            }
        },
    }
}

/// What clones over SSH (allowed by `MOAT_ALLOW_SSH_KEY=1`) need of this
/// host: its `ssh`, and host keys to trust.
fn ssh_readiness(egress: &moat_core::EgressConfig) -> String {
    let Some(ssh) = moat_core::programs::find_program("ssh") else {
        return "allowed, but this host has no ssh client (apt-get install openssh-client)".into();
    };
    let known = egress
        .ssh_known_hosts
        .clone()
        .or_else(|| std::env::var_os("HOME").map(|home| std::path::Path::new(&home).join(".ssh/known_hosts")));
    let entries = known
        .as_ref()
        .and_then(|file| std::fs::read_to_string(file).ok())
        .map(|text| text.lines().filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#')).count());
    match (known, entries) {
        (Some(file), Some(n)) if n > 0 => {
            format!("allowed; {} with host keys from {} ({n} entries)", ssh.display(), file.display())
        }
        (Some(file), entries) => format!(
            "allowed, but {} {}: every clone will be refused until the hosts are added (ssh-keyscan HOST >> it, \
             after checking the fingerprints) or MOAT_SSH_KNOWN_HOSTS names a pinned list",
            file.display(),
            if entries.is_some() { "holds no host key" } else { "cannot be read" }
        ),
        (None, _) => "allowed, but there is no home directory for ~/.ssh/known_hosts; set MOAT_SSH_KNOWN_HOSTS".into(),
    }
}

fn doctor(image_name: &str) -> ExitCode {
    let host = HostVirtualization::probe();
    let kvm = match &host.kvm_problem {
        None => "usable".to_owned(),
        Some(problem) => format!("not usable: {problem}"),
    };
    println!("/dev/kvm:                {kvm}");
    println!(
        "hardware virtualization: {}",
        host.cpu_flag.map_or_else(|| "no (no vmx/svm flag)".to_owned(), |f| format!("yes ({f})"))
    );
    let userns = std::fs::read_to_string("/proc/sys/user/max_user_namespaces").unwrap_or_default();
    println!(
        "user namespaces:         {}",
        if userns.trim().parse::<u64>().unwrap_or(0) > 0 { "available" } else { "disabled (jails cannot start)" }
    );
    let user = moat_core::hostuser::HostUser::current();
    let who = match (&user.ids, user.jail_problem()) {
        _ if user.is_root() => {
            let rootfs = moat_core::image::data_dir().join("images").join(image_name).join("rootfs");
            match moat_core::backend::ids::shared_because(&rootfs) {
                None => format!(
                    "root (each jail maps a host id range of its own, 65536 ids from {} + n × 65536, leased in {})",
                    moat_core::image::JAIL_ID_BASE,
                    moat_core::backend::ids::LEASES
                ),
                Some(why) => format!(
                    "root (every jail maps host ids from {}, so sandboxes share the kernel's per-user budgets, \
                     inotify instances and the like: {why})",
                    moat_core::image::JAIL_ID_BASE
                ),
            }
        }
        (_, Some(problem)) => format!("{} (rootless): jails cannot start: {problem}", user.display_name()),
        (Some((uids, gids)), None) => format!(
            "{} (rootless): jails map subordinate uids from {} and gids from {}",
            user.display_name(),
            uids.start,
            gids.start
        ),
        (None, None) => user.display_name(),
    };
    println!("runs as:                 {who}");
    let cgroups = CgroupSupport::probe();
    println!("cgroups:                 {}", cgroups.describe());
    let unlimited = moat_core::limits::allow_unlimited();
    let limitless = match (&cgroups, cgroups.writable(), unlimited) {
        (_, _, true) => "allowed (MOAT_ALLOW_UNLIMITED=1): a jail whose cgroups cannot be set up runs without \
                         memory, pids or CPU limits"
            .to_owned(),
        (CgroupSupport::None, _, false) => {
            "refused: this host has no cgroups, so jails cannot start; set MOAT_ALLOW_UNLIMITED=1 to run them \
             without limits"
                .to_owned()
        }
        (_, Err(problem), false) => format!(
            "refused: {problem}, so jails cannot start; run as root or in a delegated cgroup, or set \
             MOAT_ALLOW_UNLIMITED=1 to run them without limits"
        ),
        (_, Ok(()), false) => "refused (MOAT_ALLOW_UNLIMITED=1 would allow them)".to_owned(),
    };
    println!("sandboxes without limits: {limitless}");
    let moves = match moat_core::dynmods::state() {
        moat_core::dynmods::State::On => "wait for no grace period (favordynmods)".to_owned(),
        moat_core::dynmods::State::Off => "each jail's start waits for an RCU grace period to join its cgroups \
                                           (favordynmods is off); as root, run `moat setup` to turn it on"
            .to_owned(),
        moat_core::dynmods::State::Unseen => "unknown: no cgroup v2 hierarchy is mounted to show whether moves wait \
                                              for an RCU grace period; as root, `moat setup` makes sure they do not \
                                              (until reboot)"
            .to_owned(),
        moat_core::dynmods::State::NoCgroups => "none (no cgroups)".to_owned(),
    };
    println!("cgroup moves:            {moves}");
    match moat_core::limits::max_memory_mib_from_env() {
        Ok(mib) => println!(
            "memory of all sandboxes: at most {mib} MiB together, memory_mib and a jail's disk_mib \
             (MOAT_MAX_MEMORY_MIB; by default {}% of the host's)",
            moat_core::limits::DEFAULT_SHARE_PERCENT
        ),
        Err(e) => println!("memory of all sandboxes: {e}"),
    }
    match moat_core::hostfs::roots_from_env() {
        Ok(roots) if roots.is_empty() => {
            println!("shared host directories: none (the working directory is not a project directory; set MOAT_ROOTS)")
        }
        Ok(roots) => {
            let list: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
            println!("shared host directories: {}", list.join(", "));
        }
        Err(e) => println!("shared host directories: {e}"),
    }
    match moat_core::hostfs::copy_limit_from_env() {
        Ok(limit) => println!("copy limit:              {} MiB (MOAT_COPY_MAX_MIB)", limit >> 20),
        Err(e) => println!("copy limit:              {e}"),
    }
    let data_dir = moat_core::image::data_dir();
    match moat_core::state::open_to_others(&data_dir) {
        Some(open) => println!(
            "data directory:          {} — other local users can reach it (every directory down to it lets them \
             pass): they can read your images, and write into an image's tmp, var/tmp and run/lock, which are \
             open to all (jails mount their own over them, but what is put there takes your disk); close it with \
             `chmod 700 {}`",
            data_dir.display(),
            open.display()
        ),
        None => println!("data directory:          {} (closed to other local users)", data_dir.display()),
    }
    match moat_core::task::records_limit_from_env() {
        Ok(limit) => println!("task records:            at most {} MiB (MOAT_TASK_RECORDS_MIB)", limit >> 20),
        Err(e) => println!("task records:            {e}"),
    }
    let data = moat_core::image::data_dir();
    match Image::open(&data, image_name) {
        Ok(image) => println!(
            "image {image_name:?}:        {} (kernel {}, {} packages)",
            image.dir.display(),
            image.manifest.kernel.release,
            image.manifest.packages.parse().map_or(0, |p| p.len())
        ),
        Err(e) => println!("image {image_name:?}:        {e} (images live in {})", data.join("images").display()),
    }
    if let (Ok(image), Some((uids, _))) = (Image::open(&data, image_name), user.ids)
        && image.manifest.jail_id_base != uids.start
    {
        println!(
            "image {image_name:?} for jails: owned for ids from {}, not this user's {}: build one in this user's \
             range with `moat image build --name {image_name}`, or as root run `moat setup --user {}` (it copies \
             root's image into it)",
            image.manifest.jail_id_base,
            uids.start,
            user.display_name()
        );
    }
    let image_root = data.join("images").join(image_name).join("rootfs");
    println!("extra CAs (MOAT_CA_FILE): {}", extra_cas(&image_root));
    match moat_core::moat::find_agent() {
        Ok(agent) => println!("agent:                   {}", agent.display()),
        Err(e) => println!("agent:                   {e}"),
    }
    match moat_core::backend::jail::find_pasta() {
        Some(pasta) => println!("network open (jail):     pasta at {}", pasta.display()),
        None => println!("network open (jail):     unavailable: no pasta (apt-get install passt)"),
    }
    match moat_core::backend::jail::tun_problem() {
        None => println!("{:<25}usable by pasta", format!("{}:", moat_core::backend::jail::TUN)),
        Some(problem) => println!("{:<25}not usable: {problem}", format!("{}:", moat_core::backend::jail::TUN)),
    }
    match moat_core::backend::passt::find_passt() {
        Some(passt) => println!("network open (vm):       passt at {}", passt.display()),
        None => println!("network open (vm):       unavailable: no passt (apt-get install passt)"),
    }
    let vmm = moat_core::backend::machine::find_vmm();
    match &vmm {
        Some(vmm) => println!("moat-vmm:                {}", vmm.display()),
        None => println!("moat-vmm:                not found (set MOAT_VMM, or put it beside moat or on PATH)"),
    }
    match moat_core::Grants::from_env() {
        Ok(grants) => {
            println!("grants (moat-mcp):       {}", grants.describe(&moat_core::EgressConfig::from_env()));
        }
        Err(e) => println!("grants (moat-mcp):       {e}; moat-mcp will not start"),
    }
    let egress = moat_core::EgressConfig::from_env();
    if egress.ssh_keys {
        println!("git over SSH:            {}", ssh_readiness(&egress));
    }
    let choice = host.choose(BackendKind::Auto);
    match (choice.kind, &vmm) {
        (BackendKind::Vm, Some(_)) => println!("backend auto uses:       vm ({})", choice.reason),
        (BackendKind::Vm, None) => {
            println!("backend auto uses:       jail ({}, but moat-vmm is not found)", choice.reason);
        }
        _ => {
            println!("backend auto uses:       {} ({})", choice.kind, choice.reason);
            println!("for microVMs this host needs: {}", host.vm_missing());
        }
    }
    ExitCode::SUCCESS
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
