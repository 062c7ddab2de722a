//! Launching a jail: `moat-agent jail …` turns a fresh, single-threaded
//! process into the monitor of a new sandbox whose PID 1 is the agent.
//!
//! ```text
//! moat (host, multi-threaded)
//!  └─ moat-agent jail  (host root, own mount namespace; the monitor)
//!       │  tmpfs (size = disk) for the overlay's upper layer
//!       │  overlay: image rootfs/ (lower) + upper → the sandbox root
//!       │  /dev of bind-mounted safe devices, the agent binary (read-only)
//!       │  binds the agent's socket outside the sandbox, passes the fd in
//!       ├─ fork: the keeper (cgroup v1 freezer only; `crate::keeper`)
//!       └─ clone(NEWUSER|NEWNS|NEWPID|NEWNET|NEWIPC|NEWUTS|NEWCGROUP)
//!            the monitor writes uid_map/gid_map: 0..N → BASE..BASE+N
//!            PID 1: /proc, /sys, /dev/pts, /dev/shm, /tmp, /run, hostname,
//!            loopback, pivot_root, capabilities limited, no_new_privs,
//!            seccomp, then the agent: in place (the same program, see
//!            `InPlace`), or exec'd from /.moat/agent
//! ```
//!
//! The monitor dies with its parent (`PR_SET_PDEATHSIG`), PID 1 dies with
//! the monitor, and the kernel kills every process of a pid namespace whose
//! PID 1 dies: a sandbox never outlives the process that created it (on a
//! cgroup v1 freezer, where a frozen process takes no SIGKILL, the keeper
//! thaws the sandbox for those deaths). Its mounts live only in namespaces
//! that vanish with it.

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use moat_sys::beneath;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::CloneFlags;
use nix::sys::signal::Signal;
use nix::unistd::{Gid, Pid, Uid};

/// What a jail is made of; given as `moat-agent jail` flags by the host.
#[derive(Debug, Clone)]
pub struct JailSpec {
    /// The image's `rootfs/` directory: the overlay's lower layer.
    pub rootfs: PathBuf,
    /// The sandbox's state directory (mount points, the socket directory).
    pub state: PathBuf,
    /// The agent binary to run inside (this very binary, usually).
    pub agent: PathBuf,
    pub hostname: String,
    /// Host uid/gid of sandbox id 0.
    pub id_base: u32,
    pub id_count: u32,
    /// Host uid/gid the image's files are owned from, where it is not
    /// `id_base` (root's jails each map a range of their own; the image's
    /// is one): the lower layer is then an idmapped mount of `rootfs`
    /// (`moat_sys::idmap`) showing them from `id_base`. Never rootless.
    pub image_id_base: Option<u32>,
    /// The size bound of everything the sandbox writes to its root.
    pub disk_mib: u64,
    /// `cgroup.procs` files to join before the sandbox starts.
    pub cgroups: Vec<PathBuf>,
    /// Read more `cgroup.procs` paths from stdin (one a line, ended by an
    /// empty line) once the root is prepared, so that the host can make the
    /// cgroups meanwhile. A line `user <controller> <dir>` instead names a
    /// `user` cgroup to bind at `/.moat/cgroup/<controller>` (see
    /// [`crate::cgroup`]). (Paths, never secrets, travel this way or on the
    /// command line, which every host user can read.)
    pub cgroups_on_stdin: bool,
    /// Write [`READY`] to stdout once the sandbox's init is released (its
    /// id maps written, pasta attached): from then on the agent's socket
    /// exists and takes connections, which its backlog holds until the
    /// agent accepts them. The host waits on this line instead of polling.
    pub ready_on_stdout: bool,
    /// Network policy `open`: the `pasta` binary to attach to the sandbox's
    /// network namespace (see [`PASTA_ARGS`]).
    pub pasta: Option<PathBuf>,
    /// Started by an unprivileged user, whose subordinate ranges start at
    /// `id_base` (uids) and [`Rootless::gid_base`]: see [`enter_own_userns`].
    pub rootless: Option<Rootless>,
    /// The agent's serving on a listening descriptor, returning its exit
    /// status: where `agent` is the very program running this monitor, the
    /// sandbox's init runs it in place of exec'ing `agent` (see
    /// [`InPlace`]). `None`: the init always execs `agent`.
    pub serve: Option<fn(i32) -> u8>,
}

/// What a rootless monitor needs beyond [`JailSpec::id_base`].
#[derive(Debug, Clone)]
pub struct Rootless {
    /// Host gid of sandbox gid 0: the start of the user's subordinate gids.
    pub gid_base: u32,
    /// Where the user's namespace holder serves (see
    /// [`crate::userns_holder`]): joined when one serves the right maps,
    /// started there when this monitor maps its own. `None`: no holder.
    pub holder: Option<PathBuf>,
    /// How long a holder this monitor starts waits for a request before
    /// it ends.
    pub hold: std::time::Duration,
}

/// In a rootless monitor's own user namespace, the id the sandbox's ids
/// start from: 0 is the user who started moat, 1 onwards its subordinate
/// range (see [`enter_own_userns`]).
const ROOTLESS_INNER_BASE: u32 = 1;

/// How `pasta` serves an `open` sandbox: outbound NAT only. No port is
/// forwarded into the sandbox (`-t none -u none`), none of the host's
/// loopback ports are reachable from it (`-T none -U none`), and the
/// gateway address is not mapped to the host (`--no-map-gw`). DNS queries
/// to [`OPEN_DNS`] go to the host's resolver.
pub const PASTA_ARGS: &[&str] = &[
    "--foreground",
    "--quiet",
    "--config-net",
    "--tcp-ports",
    "none",
    "--udp-ports",
    "none",
    "--tcp-ns",
    "none",
    "--udp-ns",
    "none",
    "--no-map-gw",
    "--dns-forward",
    OPEN_DNS,
];

/// The resolver address an `open` sandbox's `/etc/resolv.conf` names;
/// pasta forwards what is sent there to the host's resolver.
pub const OPEN_DNS: &str = "10.0.2.3";

/// The descriptor pasta inherits the sandbox's network namespace as.
const PASTA_NETNS_FD: i32 = 100;
/// The descriptor pasta inherits the sandbox's user namespace as: pasta
/// joins it to gain the rights over the network namespace it owns.
const PASTA_USERNS_FD: i32 = 101;

/// How long pasta may take to configure the sandbox's interface.
const PASTA_GUARD: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a jail could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("Jail setup failed at {step}")]
pub struct JailError {
    step: String,
    #[source]
    source: std::io::Error,
}

fn step<T, E: Into<std::io::Error>>(what: &str, result: Result<T, E>) -> Result<T, JailError> {
    result.map_err(|e| JailError { step: what.to_owned(), source: e.into() })
}

/// The socket the agent listens on, relative to the state directory. The
/// monitor binds it as host root, outside the sandbox, and hands PID 1 the
/// listening descriptor: nothing of the host's file system is writable from
/// inside, and the sandbox cannot replace the socket the host connects to.
pub const SOCKET: &str = "sock/agent.sock";

/// The line the monitor writes to stdout when the sandbox's socket takes
/// connections (see [`JailSpec::ready_on_stdout`]).
pub const READY: &str = "ready\n";

/// The descriptor number the agent inherits its listening socket as.
const LISTEN_FD: i32 = 3;

/// Where the jail's root is mounted inside the disk's tmpfs.
const ROOT: &str = "root";

/// Devices a sandbox gets, bind-mounted from the host: harmless ones only.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// Sets up the jail and runs as its monitor until PID 1 exits; returns its
/// exit status. Must be called while the process is single-threaded.
pub fn run(spec: &JailSpec) -> Result<i32, JailError> {
    // Die with the host process; if it is already gone, stop here.
    let parent = nix::unistd::getppid();
    step("PR_SET_PDEATHSIG", nix::sys::prctl::set_pdeathsig(Signal::SIGKILL))?;
    // For the keeper (cgroup v1): the owner's end, as an event.
    let owner = step("pidfd_open of the owner", crate::pidfd::Pidfd::of_pid(parent.as_raw()))?;
    if nix::unistd::getppid() != parent {
        return Ok(1);
    }
    // Rootless: from here on the monitor works as root of a user
    // namespace of its own, and the sandbox's ids start at 1 there.
    let rootless_spec;
    let spec = match &spec.rootless {
        Some(rootless) => {
            enter_own_userns(spec.id_base, spec.id_count, rootless)?;
            // The change of namespace cleared the parent-death signal.
            step("PR_SET_PDEATHSIG", nix::sys::prctl::set_pdeathsig(Signal::SIGKILL))?;
            if nix::unistd::getppid() != parent {
                return Ok(1);
            }
            rootless_spec = JailSpec { id_base: ROOTLESS_INNER_BASE, ..spec.clone() };
            &rootless_spec
        }
        None => spec,
    };
    step("unshare(CLONE_NEWNS)", nix::sched::unshare(CloneFlags::CLONE_NEWNS))?;
    step(
        "making mounts private",
        mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>),
    )?;
    let root = prepare_root(spec)?;
    let mut cgroups = spec.cgroups.clone();
    let mut user_cgroups = Vec::new();
    let mut split = None;
    if spec.cgroups_on_stdin {
        let mut lines = std::io::BufRead::lines(std::io::stdin().lock());
        loop {
            match lines.next() {
                Some(Ok(line)) if line.is_empty() => break,
                Some(Ok(line)) => match (parse_user_cgroup(&line), Split::parse(&line)) {
                    (Some(user), _) => user_cgroups.push(user),
                    (None, Some(line)) => split = Some(line),
                    (None, None) => cgroups.push(line.into()),
                },
                // The host went away before sending: nothing to start for.
                None | Some(Err(_)) => return Ok(1),
            }
        }
    }
    if spec.rootless.is_some() {
        give_user_cgroups(&user_cgroups, spec.id_base)?;
    }
    bind_user_cgroups(&root, &user_cgroups, spec.id_base)?;
    // On a cgroup v1 freezer, the keeper that thaws the sandbox on its way
    // down (see `crate::keeper`): forked before the joins below, so that
    // no freeze of the sandbox reaches it.
    let keeper = match crate::keeper::freezer_dir(&cgroups) {
        Some(dir) => Some(step("starting the keeper", crate::keeper::Keeper::start(dir, owner))?),
        None => {
            drop(owner);
            None
        }
    };
    if let Some(keeper) = &keeper {
        KEEPER.store(keeper.wake_fd(), std::sync::atomic::Ordering::SeqCst);
    }
    // Every process of the sandbox descends from here: join before clone.
    for procs in &cgroups {
        step(&format!("joining {}", procs.display()), std::fs::write(procs, std::process::id().to_string()))?;
    }
    let sock_dir = spec.state.join("sock");
    step("creating the socket directory", std::fs::create_dir_all(&sock_dir))?;
    step("chmod the socket directory", std::fs::set_permissions(&sock_dir, std::fs::Permissions::from_mode(0o700)))?;
    let socket = spec.state.join(SOCKET);
    let _ = std::fs::remove_file(&socket);
    // std opens it close-on-exec; the sandbox's init moves it to LISTEN_FD.
    let listener = step("binding the agent's socket", std::os::unix::net::UnixListener::bind(&socket))?;
    // The sandbox's root user cannot traverse the host directories above
    // the state directory (e.g. /root, mode 700): it starts inside its root
    // instead, and reaches everything by relative paths.
    step("chdir to the sandbox root", nix::unistd::chdir(&root))?;

    let (ready_rx, ready_tx) = step("pipe", nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC))?;
    // The sandbox's init watches this monitor through a pidfd (opened
    // close-on-exec) across the moment its parent-death signal is reset.
    let own_pid = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
    let lifeline = step("pidfd_open of the monitor", crate::pidfd::Pidfd::of_pid(own_pid))?;
    let in_place = InPlace::for_spec(spec);
    let stack = step("mapping the init's stack", InitStack::new())?;
    let flags = CloneFlags::CLONE_NEWUSER
        | CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWCGROUP;
    let mut ready_rx = Some(ready_rx);
    let mut child = || match sandbox_init(spec, ready_rx.take(), &listener, &lifeline, in_place) {
        Ok(never) => match never {},
        Err(e) => {
            eprintln!("moat-agent jail: {e}: {}", e.source);
            1
        }
    };
    // The sandbox's user namespace is owned by the host uid its root maps
    // to (the owner is the creator's effective uid), never by host root:
    // - the kernel charges what the sandbox's processes hold of per-user
    //   budgets (inotify instances and watches, user and other namespaces,
    //   processes) to the owner at each level up: owned by root, a sandbox
    //   could spend host root's (128 inotify instances by default), and
    //   systemd's, udev's and every other root process's next one would fail;
    // - with pasta, run as that uid, pasta then holds rights over the
    //   sandbox's namespaces and none over the host's.
    // Rootless without pasta, the owner is already the user.
    let switch_euid = spec.pasta.is_some() || spec.rootless.is_none();
    if switch_euid {
        step("switching the effective uid", nix::unistd::seteuid(Uid::from_raw(spec.id_base)))?;
        if spec.rootless.is_some() {
            // The switch left this process non-dumpable, and the clone
            // would be too: its /proc files would then belong to host
            // root, which a rootless monitor cannot override (host root
            // has no id in its namespace), so it could not write the id
            // maps nor hand pasta the namespaces. Dumpable, they belong to
            // the clone's uid, one of this namespace's. Nothing but this
            // monitor runs as that uid until the clone execs the agent,
            // which makes itself non-dumpable again.
            step("PR_SET_DUMPABLE", nix::sys::prctl::set_dumpable(true))?;
        }
    }
    let cloned = clone_init(&mut child, &stack, flags, in_place.map(|p| p.tid_slot));
    if switch_euid {
        step("switching the effective uid back", nix::unistd::seteuid(Uid::from_raw(0)))?;
        // A change of credentials clears the parent-death signal: set it again.
        step("PR_SET_PDEATHSIG", nix::sys::prctl::set_pdeathsig(Signal::SIGKILL))?;
        if nix::unistd::getppid() != parent {
            if let Ok(pid) = &cloned {
                let _ = nix::sys::signal::kill(*pid, Signal::SIGKILL);
            }
            return Ok(1);
        }
    }
    let pid = step("clone", cloned)?;
    CHILD.store(pid.as_raw(), std::sync::atomic::Ordering::SeqCst);
    map_ids(pid, spec)?;
    if let Some(split) = &split {
        split.finish(pid, spec.id_base)?;
    }
    // pasta dies with this monitor (PR_SET_PDEATHSIG; the monitor is
    // single-threaded, so no thread's exit sets it off early).
    let _pasta = match &spec.pasta {
        Some(pasta) => Some(start_pasta(pasta, pid, spec.id_base, &spec.state.join(PASTA_LOG))?),
        None => None,
    };
    let mut ready = File::from(ready_tx);
    step("releasing the sandbox's init", ready.write_all(b"1"))?;
    drop(ready);
    if spec.ready_on_stdout {
        report_ready()?;
    }
    // SIGTERM from the host: kill the sandbox's init (the kernel then kills
    // and reaps the whole pid namespace), reap it, and exit, so that the
    // host finds the sandbox's cgroups empty once this process is gone.
    let handler = nix::sys::signal::SigAction::new(
        nix::sys::signal::SigHandler::Handler(on_term),
        nix::sys::signal::SaFlags::empty(),
        nix::sys::signal::SigSet::empty(),
    );
    // SAFETY: `on_term` only reads an atomic and calls kill(2), both
    // async-signal-safe.
    step("installing the SIGTERM handler", unsafe { nix::sys::signal::sigaction(Signal::SIGTERM, &handler) })?;
    drop(listener);
    loop {
        match nix::sys::wait::waitpid(pid, None) {
            Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => return Ok(code),
            Ok(nix::sys::wait::WaitStatus::Signaled(_, signal, _)) => return Ok(128 + signal as i32),
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(JailError { step: "waiting for the sandbox".into(), source: e.into() }),
        }
    }
}

/// Puts this (single-threaded) monitor, started by an unprivileged user,
/// into a user namespace of its own, mapped by the setuid helpers
/// `newuidmap` and `newgidmap` from the user's subordinate ranges: id 0 is
/// the user itself (so the monitor still owns the user's files: its state
/// directory, its cgroups), ids 1 to `id_count` are the subordinate range
/// from `id_base` (uids) and `rootless.gid_base` (gids). (The
/// [`crate::cgroup_sweep`] enters the same namespace.) The monitor
/// then holds every capability over namespaces it makes from here, and
/// none over the host's; the sandbox gets a user namespace of its own
/// beneath this one mapping its ids from 1 (`map_ids`), so that its root
/// is a subordinate id, never the user.
///
/// A process cannot map ids it does not own into its own namespace: a
/// helper forked beforehand runs the two setuid programs on this process
/// once it has unshared, and reports their status. They cost about 2 ms,
/// so a monitor first asks the user's namespace holder for the same
/// namespace, mapped once ([`crate::userns_holder`]), and starts one when
/// none answers.
pub fn enter_own_userns(id_base: u32, id_count: u32, rootless: &Rootless) -> Result<(), JailError> {
    let (uid, gid) = (nix::unistd::getuid().as_raw(), nix::unistd::getgid().as_raw());
    // The user's namespace, as its holder keeps it, if one serves.
    let want = crate::userns_holder::Maps {
        uid: vec![[0, uid.into(), 1], [ROOTLESS_INNER_BASE.into(), id_base.into(), id_count.into()]],
        gid: vec![[0, gid.into(), 1], [ROOTLESS_INNER_BASE.into(), rootless.gid_base.into(), id_count.into()]],
    };
    if let Some(socket) = &rootless.holder {
        match crate::userns_holder::join(socket, &want) {
            Ok(()) => return Ok(()),
            // Not an error: this monitor maps its own, as below.
            Err(why) => eprintln!("moat-agent jail: mapping a user namespace of its own: {why}"),
        }
    }
    map_own_userns(id_base, id_count, rootless, uid, gid)?;
    if let Some(socket) = &rootless.holder
        && let Err(e) = crate::userns_holder::start(socket, rootless.hold)
    {
        eprintln!("moat-agent jail: cannot start a namespace holder at {} ({e})", socket.display());
    }
    Ok(())
}

/// [`enter_own_userns`] without a holder: unshare, then the two set-uid
/// helpers map the new namespace.
fn map_own_userns(id_base: u32, id_count: u32, rootless: &Rootless, uid: u32, gid: u32) -> Result<(), JailError> {
    let target = std::process::id();
    let (go_rx, go_tx) = step("pipe", nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC))?;
    let maps = [
        ("newuidmap", format!("{target} 0 {uid} 1 {ROOTLESS_INNER_BASE} {id_base} {id_count}")),
        ("newgidmap", format!("{target} 0 {gid} 1 {ROOTLESS_INNER_BASE} {} {id_count}", rootless.gid_base)),
    ];
    // SAFETY: the monitor is single-threaded (run's contract): the child
    // holds no lock another thread owned. It waits for a byte, runs the
    // two helpers side by side and exits without returning.
    match step("fork", unsafe { nix::unistd::fork() })? {
        nix::unistd::ForkResult::Child => {
            drop(go_tx);
            let mut byte = [0u8; 1];
            let go = File::from(go_rx).read_exact(&mut byte).is_ok();
            // Both helpers at once: each writes a map of its own, and the
            // jail's start waits for the slower one instead of their sum.
            let started: Vec<_> = if go {
                maps.iter()
                    .map(|(helper, args)| {
                        let child = std::process::Command::new(helper)
                            .args(args.split(' '))
                            .stdin(std::process::Stdio::null())
                            .stdout(std::process::Stdio::null())
                            .spawn();
                        (helper, args, child)
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let mapped = go
                && started.into_iter().fold(true, |all, (helper, args, child)| {
                    let ok = match child.and_then(|mut c| c.wait()) {
                        Ok(s) if s.success() => true,
                        Ok(s) => {
                            eprintln!("moat-agent jail: {helper} {args} failed ({s})");
                            false
                        }
                        Err(e) => {
                            eprintln!("moat-agent jail: cannot run {helper} ({e}); `apt-get install uidmap`");
                            false
                        }
                    };
                    all && ok
                });
            // SAFETY: _exit ends this forked child at once, running no
            // destructor of state it shares with its parent.
            unsafe { libc::_exit(if mapped { 0 } else { 1 }) }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(go_rx);
            let unshared = nix::sched::unshare(CloneFlags::CLONE_NEWUSER);
            // The helper is told either way, and so never waits forever.
            let _ = File::from(go_tx).write_all(if unshared.is_ok() { b"1" } else { b"" });
            let status = nix::sys::wait::waitpid(child, None);
            step("unshare(CLONE_NEWUSER)", unshared)?;
            match status {
                Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(()),
                other => Err(JailError {
                    step: "mapping the user's subordinate ids".into(),
                    source: std::io::Error::other(format!(
                        "newuidmap or newgidmap failed ({other:?}; the jail's log has their words): check that \
                         /etc/subuid and /etc/subgid give this user {} ids from {} and {} (`moat doctor`)",
                        id_count, id_base, rootless.gid_base
                    )),
                }),
            }
        }
    }
}

/// Tells the host on stdout that the socket takes connections, then points
/// stdout at stderr (the log): the host reads one line, and nothing else
/// the monitor prints can be mistaken for it.
fn report_ready() -> Result<(), JailError> {
    let mut stdout = std::io::stdout().lock();
    step("reporting readiness", stdout.write_all(READY.as_bytes()).and_then(|()| stdout.flush()))?;
    // SAFETY: dup2 of this process's own stderr onto its stdout; the
    // monitor is single-threaded and holds stdout's lock meanwhile.
    if unsafe { libc::dup2(2, 1) } < 0 {
        return Err(JailError { step: "closing the readiness pipe".into(), source: std::io::Error::last_os_error() });
    }
    Ok(())
}

/// Where pasta's stderr goes, relative to the state directory: read back
/// into the error when pasta fails to start.
const PASTA_LOG: &str = "pasta.log";

/// How much of pasta's stderr an error quotes.
const PASTA_LOG_QUOTED: u64 = 2048;

/// Attaches pasta to the network namespace of `pid` and waits until the
/// namespace has a default route. pasta's stderr goes to `log`.
fn start_pasta(pasta: &Path, pid: Pid, owner: u32, log: &Path) -> Result<std::process::Child, JailError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    // pasta runs as the namespaces' owner uid, which may not open the
    // monitor's child's /proc/PID/ns: it gets them as inherited
    // descriptors instead, opened here as root.
    let netns = step("opening the sandbox's network namespace", File::open(format!("/proc/{pid}/ns/net")))?;
    let userns = step("opening the sandbox's user namespace", File::open(format!("/proc/{pid}/ns/user")))?;
    let (netns_fd, userns_fd) = (netns.as_raw_fd(), userns.as_raw_fd());
    let mut command = std::process::Command::new(pasta);
    command
        .args(PASTA_ARGS)
        .arg("--userns")
        .arg(format!("/proc/self/fd/{PASTA_USERNS_FD}"))
        .arg("--netns")
        .arg(format!("/proc/self/fd/{PASTA_NETNS_FD}"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(step("creating pasta's log", File::create(log))?);
    // pasta starts as the owner uid rather than dropping to it itself
    // (`--runas`): a change of credentials would clear the parent-death
    // signal, which is set last, so pasta dies with this monitor.
    // SAFETY: the closure runs in the forked child before exec and only
    // makes async-signal-safe system calls (dup2, setgroups, setresgid,
    // setresuid, signal, setrlimit, prctl); dup2 targets descriptor numbers
    // nothing in the child uses.
    unsafe {
        command.pre_exec(move || {
            let id = owner;
            if libc::dup2(netns_fd, PASTA_NETNS_FD) < 0
                || libc::dup2(userns_fd, PASTA_USERNS_FD) < 0
                || libc::setgroups(0, std::ptr::null()) < 0
                || libc::setresgid(id, id, id) < 0
                || libc::setresuid(id, id, id) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // What the sandbox's traffic makes it log stays bounded.
            moat_sys::fds::cap_file_writes(moat_sys::fds::HELPER_LOG_MAX)?;
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            Ok(())
        });
    }
    // Route changes in the sandbox's namespace, heard before pasta starts:
    // none can be missed between the check and the wait below.
    let routes = step("watching the sandbox's routes", RouteWatch::open(&netns))?;
    let mut child = step(&format!("starting {}", pasta.display()), command.spawn())?;
    drop((netns, userns));
    let exited = step("watching pasta", crate::pidfd::Pidfd::of_pid(crate::reaper::pid_of(&child)))?;
    let deadline = std::time::Instant::now() + PASTA_GUARD;
    loop {
        if has_default_route(pid) {
            return Ok(child);
        }
        if let Ok(Some(status)) = child.try_wait() {
            let what = format!("pasta exited ({status}) before configuring the network");
            return Err(pasta_failed(&what, log));
        }
        if !routes.wait(&exited, deadline) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(pasta_failed("pasta did not configure the network within 10 s", log));
        }
    }
}

/// Whether the network namespace of `pid` has a default route:
/// destination 00000000 in the second column of its IPv4 route table.
fn has_default_route(pid: Pid) -> bool {
    let routes = std::fs::read_to_string(format!("/proc/{pid}/net/route")).unwrap_or_default();
    routes.lines().skip(1).any(|l| l.split_whitespace().nth(1) == Some("00000000"))
}

/// A netlink socket in a network namespace that hears its IPv4 route
/// changes (`RTMGRP_IPV4_ROUTE`): what pasta's configuring is waited on.
struct RouteWatch(OwnedFd);

impl RouteWatch {
    /// Opens the socket inside the namespace `netns` (a netlink socket
    /// belongs to the namespace it was made in), from a thread of its own
    /// that enters the namespace and ends there: a rootless monitor could
    /// enter the sandbox's namespace but not return to the host's (owned
    /// by the host's user namespace, where it holds no capability), and
    /// setns(2) moves only the calling thread.
    fn open(netns: &File) -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        let (fd, made) = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    nix::sched::setns(netns, CloneFlags::CLONE_NEWNET)?;
                    // SAFETY: socket(2) with constant arguments; it returns
                    // a new descriptor or -1.
                    let fd = unsafe {
                        libc::socket(
                            libc::AF_NETLINK,
                            libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                            libc::NETLINK_ROUTE,
                        )
                    };
                    Ok::<_, std::io::Error>((fd, std::io::Error::last_os_error()))
                })
                .join()
                .map_err(|_| std::io::Error::other("the thread opening the route socket panicked"))?
        })?;
        if fd < 0 {
            return Err(made);
        }
        // SAFETY: the kernel just returned this descriptor; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain data; all zeroes is its empty value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::sa_family_t::try_from(libc::AF_NETLINK).unwrap_or_default();
        addr.nl_groups = libc::c_uint::try_from(libc::RTMGRP_IPV4_ROUTE).unwrap_or_default();
        let len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_nl>()).unwrap_or_default();
        use std::os::fd::AsRawFd;
        // SAFETY: `addr` is a sockaddr_nl of `len` bytes on this stack.
        if unsafe { libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(fd))
    }

    /// Waits until a route changes, `pasta` ends, or `deadline`; false at
    /// the deadline. Heard messages are drained: the route table is read
    /// again by the caller.
    fn wait(&self, pasta: &crate::pidfd::Pidfd, deadline: std::time::Instant) -> bool {
        use std::os::fd::AsRawFd;
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut fds = [
            libc::pollfd { fd: self.0.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: pasta.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: two pollfds that live on this stack for the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        let mut buf = [0u8; 8192];
        // SAFETY: recv into a buffer of its length; the socket does not block.
        while unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) } > 0 {}
        // An interrupted poll is a wakeup like any other: the caller checks.
        ready != 0
    }
}

/// The error for a pasta that failed to start: `what` happened, what pasta
/// said (its stderr, on one line: the host quotes the log's last lines),
/// and where to look next.
fn pasta_failed(what: &str, log: &Path) -> JailError {
    let said = File::open(log)
        .and_then(|f| {
            let mut text = String::new();
            f.take(PASTA_LOG_QUOTED).read_to_string(&mut text).map(|_| text)
        })
        .unwrap_or_default();
    let said: Vec<&str> = said.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let said = if said.is_empty() { "nothing".to_owned() } else { said.join(" / ") };
    let e = std::io::Error::other(format!(
        "{what}; pasta said: {said}. `moat doctor` checks what pasta needs (/dev/net/tun mode 0666, \
         user namespaces); or create the sandbox with network none or filtered"
    ));
    JailError { step: "attaching pasta".into(), source: e }
}

/// The sandbox's init, for the SIGTERM handler.
static CHILD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Kills the sandbox's init right in the handler: no window in which a
/// SIGTERM is noted but nobody acts on it.
extern "C" fn on_term(_: libc::c_int) {
    let pid = CHILD.load(std::sync::atomic::Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill(2) is async-signal-safe and touches no memory.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    // Then the keeper thaws what a freeze holds back from that kill.
    let keeper = KEEPER.load(std::sync::atomic::Ordering::SeqCst);
    if keeper >= 0 {
        // SAFETY: write(2) is async-signal-safe; it reads one byte of a
        // static.
        unsafe { libc::write(keeper, c"1".as_ptr().cast(), 1) };
    }
}

/// The write end of the keeper's wake pipe, or -1 without a keeper.
static KEEPER: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// The cgroup v2 split of a sandbox's cgroup, finished here: the line
/// `split <dir> <user memory bytes> <user pids>` from the host.
///
/// The host made `<dir>` with the sandbox's limits and its empty `agent`
/// and `user` children; this monitor joined `<dir>` before cloning, so the
/// sandbox's cgroup namespace is rooted there, above both halves (where
/// the cgroup file system is mounted with `nsdelegate`, as systemd does, a
/// process may move others only within its namespace). cgroup v2 keeps
/// processes only in leaves once a cgroup enables controllers below it,
/// so the sandbox moves to `agent` before they are enabled.
#[derive(Debug, PartialEq, Eq)]
struct Split {
    dir: PathBuf,
    user_memory: u64,
    user_pids: u64,
}

/// The agent's CPU weight against its commands' 100 (the kernel's
/// default), as `cpu.shares` 4096 against 1024 on cgroup v1.
const AGENT_CPU_WEIGHT: u32 = 400;

impl Split {
    fn parse(line: &str) -> Option<Self> {
        let mut fields = line.strip_prefix("split ")?.rsplitn(3, ' ');
        let user_pids = fields.next()?.parse().ok()?;
        let user_memory = fields.next()?.parse().ok()?;
        let dir = PathBuf::from(fields.next()?);
        dir.is_absolute().then_some(Self { dir, user_memory, user_pids })
    }

    /// Moves this monitor and the sandbox (`child`, not yet released) into
    /// `agent`, enables the controllers below, limits `user`, and gives the
    /// sandbox's root (`owner`) what the agent needs to make per-command
    /// cgroups in `user` and move its commands there: `user` itself and
    /// the `cgroup.procs` of their common ancestor, not any limit file.
    fn finish(&self, child: Pid, owner: u32) -> Result<(), JailError> {
        let write = |path: PathBuf, value: String| {
            step(&format!("writing {value} to {}", path.display()), std::fs::write(&path, &value))
        };
        let (agent, user) = (self.dir.join("agent"), self.dir.join("user"));
        write(agent.join("cgroup.procs"), std::process::id().to_string())?;
        write(agent.join("cgroup.procs"), child.to_string())?;
        write(self.dir.join("cgroup.subtree_control"), "+memory +pids".into())?;
        // A CPU weight where the host delegates the CPU controller.
        let cpu = std::fs::write(self.dir.join("cgroup.subtree_control"), "+cpu").is_ok();
        write(user.join("memory.max"), self.user_memory.to_string())?;
        let _ = std::fs::write(user.join("memory.swap.max"), "0");
        write(user.join("pids.max"), self.user_pids.to_string())?;
        write(user.join("cgroup.subtree_control"), if cpu { "+memory +pids +cpu" } else { "+memory +pids" }.into())?;
        // Sandbox root may make cgroups in `user`: at most so many, so
        // deep. Memory cgroup ids are a count of the whole host's (65535),
        // and each cgroup costs the kernel memory its limit does not see.
        // These two files stay root's.
        write(user.join("cgroup.max.descendants"), USER_CGROUPS_MAX.to_string())?;
        write(user.join("cgroup.max.depth"), USER_CGROUPS_DEPTH.to_string())?;
        if cpu {
            write(agent.join("cpu.weight"), AGENT_CPU_WEIGHT.to_string())?;
            // The sandbox's quota becomes the commands' and, as much
            // again, the agent's (see `moat_core::cgroup`): a quota shared
            // with a fork bomb's kernel time throttles the agent.
            // Best effort, in this order: the sandbox's quota is lifted
            // only once both halves have it.
            if let Ok(quota) = std::fs::read_to_string(self.dir.join("cpu.max"))
                && !quota.starts_with("max")
                && std::fs::write(user.join("cpu.max"), quota.trim()).is_ok()
                && std::fs::write(agent.join("cpu.max"), quota.trim()).is_ok()
            {
                let _ = std::fs::write(self.dir.join("cpu.max"), "max");
            }
        }
        let (uid, gid) = (Some(Uid::from_raw(owner)), Some(Gid::from_raw(owner)));
        for path in [
            self.dir.join("cgroup.procs"),
            user.clone(),
            user.join("cgroup.procs"),
            user.join("cgroup.subtree_control"),
            user.join("cgroup.threads"),
        ] {
            step(&format!("giving the sandbox {}", path.display()), nix::unistd::chown(&path, uid, gid))?;
        }
        Ok(())
    }
}

/// The most cgroups sandbox root may have beneath its `user` cgroup on
/// cgroup v2 (the agent makes one per command running, and keeps a few
/// idle ones for the next): a thousand commands at once, far more than a
/// sandbox's process limit lets run.
const USER_CGROUPS_MAX: u32 = 1024;
/// How deep: the agent's command cgroups, and one level within them.
const USER_CGROUPS_DEPTH: u32 = 2;

/// Reads a `user <controller> <dir>` line: a `user` cgroup to bind.
fn parse_user_cgroup(line: &str) -> Option<(String, PathBuf)> {
    let (name, dir) = line.strip_prefix("user ")?.split_once(' ')?;
    let plain = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    (plain && dir.starts_with('/')).then(|| (name.to_owned(), PathBuf::from(dir)))
}

/// Rootless: gives the sandbox's root its `user` cgroups, which the host,
/// unprivileged, could not (only this namespace maps the ids it would
/// chown to). Each stays the user's and becomes the group of sandbox root
/// (`inner_base`), mode 0770: the agent makes its per-command cgroups in
/// it, and the host can still remove them when the sandbox ends. Other
/// host users cannot reach it: its parent is the user's, mode 0700 (the
/// agent reaches it through its bind mount, not that path).
fn give_user_cgroups(user_cgroups: &[(String, PathBuf)], inner_base: u32) -> Result<(), JailError> {
    for (name, dir) in user_cgroups {
        let what = format!("giving the sandbox its {name} user cgroup");
        step(&what, nix::unistd::chown(dir, None, Some(Gid::from_raw(inner_base))))?;
        step(&what, std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o770)))?;
        if let Some(parent) = dir.parent() {
            step(&what, std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700)))?;
        }
    }
    Ok(())
}

/// Binds each `user` cgroup directory at `/.moat/cgroup/<controller>`
/// inside the root, where the agent makes its per-command cgroups.
fn bind_user_cgroups(root: &Path, user_cgroups: &[(String, PathBuf)], id_base: u32) -> Result<(), JailError> {
    if user_cgroups.is_empty() {
        return Ok(());
    }
    // Beneath the merged root's descriptor, following no symlink of the
    // image's (see `prepare_root`).
    let root = step("opening the merged root", beneath::open_root(root))?;
    let base = Path::new(crate::cgroup::USER_CGROUPS.trim_start_matches('/'));
    let base = step("creating /.moat/cgroup", beneath::make_dirs(root.as_fd(), base))?;
    step("chown /.moat/cgroup", beneath::chown(&base, id_base, id_base))?;
    // Only the agent (the sandbox's root) reaches them, not the commands it
    // runs as `user`.
    step("chmod /.moat/cgroup", beneath::chmod(&base, 0o700))?;
    for (name, dir) in user_cgroups {
        let target = step("creating a cgroup mount point", beneath::make_dirs(base.as_fd(), Path::new(name)))?;
        let flags = MsFlags::MS_BIND | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        let target = beneath::path_of(&target);
        step(&format!("binding the {name} user cgroup"), mount(Some(dir), &target, None::<&str>, flags, None::<&str>))?;
    }
    Ok(())
}

/// In the monitor's private mount namespace, as host root: the disk, the
/// overlay root, /dev, the agent binary and the socket directory.
fn prepare_root(spec: &JailSpec) -> Result<PathBuf, JailError> {
    let base = (Some(Uid::from_raw(spec.id_base)), Some(Gid::from_raw(spec.id_base)));
    let disk = spec.state.join("disk");
    step(&format!("creating {}", disk.display()), std::fs::create_dir_all(&disk))?;
    let size = format!("size={}m,mode=0755", spec.disk_mib);
    step(
        "mounting the disk tmpfs",
        mount(Some("moat-disk"), &disk, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some(size.as_str())),
    )?;
    // The root's mount point is a directory of the tmpfs too: one fewer
    // made and removed on the host's disk per sandbox (on ext4 with
    // `discard`, a block, and a request to the device when it goes).
    let (upper, work, root) = (disk.join("upper"), disk.join("work"), disk.join(ROOT));
    for dir in [&upper, &work, &root] {
        step("creating overlay directories", std::fs::create_dir(dir))?;
    }
    step("chown upper", nix::unistd::chown(&upper, base.0, base.1))?;
    // The overlay's directories by descriptor: its options show in the
    // sandbox's mountinfo, where host paths (the user's home, the data
    // directory, the sandbox's state) have no business.
    let open_path = beneath::open_root;
    // Owned from another range than the jail's: shown in the jail's
    // through an idmapped bind mount, itself in the tmpfs (the sandbox's
    // root, pivoted to, leaves it behind with the rest of the host's).
    let lower = match spec.image_id_base.filter(|image| *image != spec.id_base) {
        Some(from) => {
            let shifted = disk.join("lower");
            step("creating the shifted image's mount point", std::fs::create_dir(&shifted))?;
            let shift = moat_sys::idmap::Shift { from, to: spec.id_base, count: spec.id_count };
            step(
                "mounting the image shifted to the jail's ids",
                moat_sys::idmap::mount_shifted(&spec.rootfs, &shifted, shift),
            )?;
            shifted
        }
        None => spec.rootfs.clone(),
    };
    let layers = [
        step("opening the image's rootfs", open_path(&lower))?,
        step("opening the overlay's upper directory", open_path(&upper))?,
        step("opening the overlay's work directory", open_path(&work))?,
    ];
    let [lower_fd, upper_fd, work_fd] = layers.each_ref().map(std::os::fd::AsRawFd::as_raw_fd);
    let options =
        format!("lowerdir=/proc/self/fd/{lower_fd},upperdir=/proc/self/fd/{upper_fd},workdir=/proc/self/fd/{work_fd}");
    step(
        "mounting the overlay root",
        mount(
            Some("moat-root"),
            &root,
            Some("overlay"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(options.as_str()),
        ),
    )?;
    drop(layers);
    // The merged root shows the image's tree, whose names moat does not
    // trust: a symlink there (`.moat -> /etc`) followed by path text would
    // have this monitor, host root, create, chown or remove host files.
    // Everything below is made beneath the root's descriptor, following no
    // symlink, and used through its own (`moat_sys::beneath`).
    let top = step("opening the merged root", beneath::open_root(&root))?;

    // /dev: a tmpfs with bind mounts of harmless host devices.
    let dev = step("creating /dev", beneath::make_dirs(top.as_fd(), Path::new("dev")))?;
    step(
        "mounting /dev",
        mount(
            Some("moat-dev"),
            &beneath::path_of(&dev),
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some("mode=0755,size=64k"),
        ),
    )?;
    // The tmpfs now there, by its name again (the descriptor above is of
    // the directory beneath it).
    let dev = step("opening /dev", beneath::dir(top.as_fd(), Path::new("dev")))?;
    for name in DEVICES {
        let node = OwnedFd::from(step("creating a device node", beneath::create_file(dev.as_fd(), name))?);
        let source = Path::new("/dev").join(name);
        step(
            &format!("binding /dev/{name}"),
            mount(Some(&source), &beneath::path_of(&node), None::<&str>, MsFlags::MS_BIND, None::<&str>),
        )?;
    }
    for dir in ["pts", "shm"] {
        step("creating /dev dirs", beneath::make_dirs(dev.as_fd(), Path::new(dir)))?;
    }
    // /dev/shm, /tmp and /run: directories of the disk's tmpfs bound in,
    // so that every file the sandbox writes comes out of one budget, its
    // disk size, and its memory size stays its processes'. (A tmpfs of
    // their own each, sized like the disk, let files take three disks'
    // worth of the memory limit, which holds both: a sandbox that filled
    // them had no memory left to run the `rm` that would free it.)
    //
    // /var/tmp too: the image's is open to everyone on the host (its tree
    // may be reachable by other local users), so nothing put in it there
    // is seen in a sandbox.
    for (name, parent, target, mode) in [
        ("shm", &dev, "shm", 0o1777),
        ("tmp", &top, "tmp", 0o1777),
        ("run", &top, "run", 0o755),
        ("var-tmp", &top, "var/tmp", 0o1777),
    ] {
        let source = disk.join("volatile").join(name);
        step("creating the disk's volatile directories", std::fs::create_dir_all(&source))?;
        step("chown a volatile directory", nix::unistd::chown(&source, base.0, base.1))?;
        step(
            "setting a volatile directory's mode",
            std::fs::set_permissions(&source, std::os::unix::fs::PermissionsExt::from_mode(mode)),
        )?;
        let target = step(&format!("creating {target}"), beneath::make_dirs(parent.as_fd(), Path::new(target)))?;
        let target = beneath::path_of(&target);
        step(&format!("binding /{name}"), mount(Some(&source), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>))?;
    }
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        step("creating /dev links", beneath::symlink(dev.as_fd(), link, target))?;
    }
    step("chown /dev", beneath::chown(&dev, spec.id_base, spec.id_base))?;

    // /.moat: the agent binary (read-only) and the socket directory.
    let moat = step("creating /.moat", beneath::make_dirs(top.as_fd(), Path::new(".moat")))?;
    step("creating /.moat/old", beneath::make_dirs(moat.as_fd(), Path::new("old")))?;
    let agent = OwnedFd::from(step("creating /.moat/agent", beneath::create_file(moat.as_fd(), "agent"))?);
    step(
        "binding the agent",
        mount(Some(&spec.agent), &beneath::path_of(&agent), None::<&str>, MsFlags::MS_BIND, None::<&str>),
    )?;
    // The bind mount now there, by its name again.
    let bound =
        beneath::open(moat.as_fd(), Path::new("agent"), nix::fcntl::OFlag::O_PATH, nix::sys::stat::Mode::empty());
    let bound = step("opening /.moat/agent", bound)?;
    step(
        "making the agent read-only",
        mount(
            None::<&str>,
            &beneath::path_of(&bound),
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
            None::<&str>,
        ),
    )?;
    step("chown /.moat", beneath::chown(&moat, spec.id_base, spec.id_base))?;
    if spec.pasta.is_some() {
        let etc = step("creating /etc", beneath::make_dirs(top.as_fd(), Path::new("etc")))?;
        let _ = beneath::remove_file(etc.as_fd(), "resolv.conf");
        let mut resolv = step("writing /etc/resolv.conf", beneath::create_file(etc.as_fd(), "resolv.conf"))?;
        step("writing /etc/resolv.conf", resolv.write_all(format!("nameserver {OPEN_DNS}\n").as_bytes()))?;
    }
    Ok(root)
}

fn map_ids(pid: Pid, spec: &JailSpec) -> Result<(), JailError> {
    let map = format!("0 {} {}\n", spec.id_base, spec.id_count);
    step("writing uid_map", std::fs::write(format!("/proc/{pid}/uid_map"), &map))?;
    step("writing gid_map", std::fs::write(format!("/proc/{pid}/gid_map"), &map))
}

/// PID 1 of the new namespaces, until it execs the agent. Starts with the
/// sandbox root as its working directory.
fn sandbox_init(
    spec: &JailSpec,
    ready: Option<OwnedFd>,
    listener: &std::os::unix::net::UnixListener,
    monitor: &crate::pidfd::Pidfd,
    in_place: Option<InPlace>,
) -> Result<std::convert::Infallible, JailError> {
    step("PR_SET_PDEATHSIG", nix::sys::prctl::set_pdeathsig(Signal::SIGKILL))?;
    let mut byte = [0u8; 1];
    if let Some(fd) = ready {
        step("waiting for the id maps", File::from(fd).read_exact(&mut byte))?;
    }
    step("setgroups", nix::unistd::setgroups(&[]))?;
    step("setresgid", nix::unistd::setresgid(Gid::from_raw(0), Gid::from_raw(0), Gid::from_raw(0)))?;
    step("setresuid", nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)))?;
    // The change of credentials cleared the parent-death signal set above
    // (prctl(2)): without it this init, and the sandbox with it, would
    // outlive a killed monitor. Set it again, then check that the monitor
    // did not end in between (its pidfd reads ready once it has).
    step("PR_SET_PDEATHSIG", nix::sys::prctl::set_pdeathsig(Signal::SIGKILL))?;
    if crate::pidfd::wait_all(std::slice::from_ref(monitor), std::time::Instant::now()) {
        return step("checking that the monitor lives", Err(std::io::Error::other("it has ended")));
    }

    // The overlay was mounted in the monitor's namespace, so here it is a
    // locked mount, which pivot_root refuses: bind it onto itself to get one
    // of this namespace's own, and step into the new mount (from its
    // parent: the working directory still points below it).
    step(
        "binding the root onto itself",
        mount(Some("."), ".", None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>),
    )?;
    step("entering the bound root", nix::unistd::chdir("..").and_then(|()| nix::unistd::chdir(ROOT)))?;
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    let mounts: &[(&str, &str, &str, MsFlags, Option<&str>)] = &[
        ("proc", "proc", "proc", nosuid | MsFlags::MS_NOEXEC, None),
        ("sysfs", "sys", "sysfs", nosuid | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY, None),
        (
            "devpts",
            "dev/pts",
            "devpts",
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some("newinstance,ptmxmode=0666,mode=0620"),
        ),
    ];
    // Beneath the root's descriptor, as the monitor made the rest: a
    // symlink of the image's (`sys -> /tmp/x`) would otherwise lead these
    // out of the root, into the host's tree this namespace still shows.
    let top = step("opening the root", beneath::open_root(Path::new(".")))?;
    for (source, target, fstype, flags, data) in mounts {
        let at = step(&format!("creating /{target}"), beneath::make_dirs(top.as_fd(), Path::new(target)))?;
        step(
            &format!("mounting /{target}"),
            mount(Some(*source), &beneath::path_of(&at), Some(*fstype), *flags, *data),
        )?;
    }
    drop(top);
    step("sethostname", nix::unistd::sethostname(&spec.hostname))?;
    step("bringing up loopback", crate::init::loopback_up())?;
    // An `open` jail reaches what the host does, but for the cloud's
    // metadata services; the other policies have no route out at all.
    if spec.pasta.is_some() {
        step("keeping the cloud's metadata services out of reach", crate::init::prohibit_metadata_services())?;
    }

    step("pivot_root", nix::unistd::pivot_root(".", ".moat/old"))?;
    step("chdir /", nix::unistd::chdir("/"))?;
    step("detaching the host's root", umount2("/.moat/old", MntFlags::MNT_DETACH))?;
    let _ = std::fs::remove_dir("/.moat/old");

    // ICMP echo sockets for every sandbox group (`ping` without raw
    // sockets, which the filter refuses), as Docker sets; best effort.
    let _ = std::fs::write("/proc/sys/net/ipv4/ping_group_range", format!("0 {}", spec.id_count.saturating_sub(1)));

    // Setup is done: from here on, at most the capabilities sandbox root
    // keeps (no CAP_NET_RAW, CAP_NET_ADMIN, CAP_SYS_ADMIN, …), for the
    // agent and everything it runs.
    step("dropping capabilities", crate::capabilities::limit_to_kept())?;
    step("PR_SET_NO_NEW_PRIVS", nix::sys::prctl::set_no_new_privs())?;
    crate::seccomp::install()
        .map_err(|e| JailError { step: "installing the seccomp filter".into(), source: std::io::Error::other(e) })?;

    // The listening socket becomes LISTEN_FD (dup2 clears close-on-exec);
    // stdin, stdout and stderr, until now the host's log file, become
    // /dev/null: no descriptor of a host file crosses into the sandbox.
    use std::os::fd::AsRawFd;
    let redirect = |from: i32, to: i32| {
        // SAFETY: dup2 on descriptors this process owns; the targets are
        // stdio and LISTEN_FD, which nothing else here uses any more, and
        // the process execs right after.
        if unsafe { libc::dup2(from, to) } < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
    };
    if listener.as_raw_fd() == LISTEN_FD {
        // dup2 onto itself would keep close-on-exec: clear it instead.
        step(
            "passing the listening socket",
            nix::fcntl::fcntl(listener, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty())).map(drop),
        )?;
    } else {
        step("passing the listening socket", redirect(listener.as_raw_fd(), LISTEN_FD))?;
    }
    let null = step("opening /dev/null", File::options().read(true).write(true).open("/dev/null"))?;
    for fd in 0..3 {
        step("redirecting stdio", redirect(null.as_raw_fd(), fd))?;
    }
    drop(null);
    // Every other descriptor goes: whatever moat's own parent left open
    // without close-on-exec (a supervisor's, a shell's) was inherited by
    // the monitor and so by this process, and the agent would hand it to
    // every command.
    // SAFETY: close_range(2) on descriptors of this process only; none
    // above LISTEN_FD is used from here to the exec.
    if unsafe { libc::syscall(libc::SYS_close_range, LISTEN_FD + 1, u32::MAX, 0) } != 0 {
        // Linux before 5.9: each open one, by the list /proc (mounted
        // above) gives.
        for fd in step("listing inherited descriptors", moat_sys::fds::open_above(LISTEN_FD))? {
            // SAFETY: close(2) of a number this process had open; the
            // listing's own descriptor, gone by now, fails harmlessly.
            unsafe { libc::close(fd) };
        }
    }
    let program = c(AGENT_IN_SANDBOX);
    let listen = format!("fd:{LISTEN_FD}");
    let args = [program.clone(), c("--listen"), c(&listen), c("--log-level"), c("warn")];
    if let Some(in_place) = in_place {
        in_place.serve(&args)
    }
    let env: Vec<CString> = AGENT_ENV.iter().map(|(name, value)| c(&format!("{name}={value}"))).collect();
    match nix::unistd::execve(&program, &args, &env) {
        Ok(never) => match never {},
        Err(e) => Err(JailError { step: "exec /.moat/agent".into(), source: e.into() }),
    }
}

/// Where the sandbox finds the agent's binary (bound read-only).
const AGENT_IN_SANDBOX: &str = "/.moat/agent";

/// The agent's environment in the sandbox (a command's comes with its
/// request).
const AGENT_ENV: &[(&str, &str)] =
    &[("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"), ("LANG", "C.UTF-8")];

/// The sandbox's init serving as the agent without exec'ing it: the init is
/// a copy of this monitor, which is the agent's program, so the exec would
/// only start the same program again — map it, relocate it, let glibc probe
/// the CPU's caches (some 80 `cpuid`, each a VM exit under nested
/// virtualization), parse its flags — about 1.5 ms of each sandbox's start.
///
/// What the exec gave, the init makes itself before serving: a fresh
/// thread identity in glibc (the clone writes the child's tid where glibc
/// keeps it, [`glibc_tid_slot`], as glibc's own `fork` does), the agent's
/// name, command line and environment as the sandbox sees them (the
/// monitor's command line names host paths and ids, and `/proc/1/cmdline`
/// is readable by every sandbox process), non-dumpable. The capabilities,
/// the seccomp filter and the descriptors are the same either way: set
/// before the exec, kept across it.
#[derive(Debug, Clone, Copy)]
struct InPlace {
    serve: fn(i32) -> u8,
    tid_slot: *mut libc::pid_t,
}

impl InPlace {
    /// Serving in place, where `spec` allows it: the agent it names is this
    /// very program (the same file), and glibc's tid slot is where it is
    /// expected. Otherwise the init execs the agent.
    fn for_spec(spec: &JailSpec) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let serve = spec.serve?;
        let (agent, this) = (std::fs::metadata(&spec.agent).ok()?, std::fs::metadata("/proc/self/exe").ok()?);
        if (agent.dev(), agent.ino()) != (this.dev(), this.ino()) {
            return None;
        }
        Some(Self { serve, tid_slot: glibc_tid_slot()? })
    }

    /// Becomes the agent `args` would exec, and serves on [`LISTEN_FD`]
    /// until it ends, then exits with its status. Returns only if it could
    /// not take the agent's looks; the caller then execs.
    fn serve(self, args: &[CString]) {
        if show_command_line(args).is_err() || nix::sys::prctl::set_dumpable(false).is_err() {
            return;
        }
        let _ = nix::sys::prctl::set_name(c"agent");
        let inherited: Vec<_> = std::env::vars_os().map(|(name, _)| name).collect();
        for name in inherited {
            // SAFETY: the init is single-threaded (cloned from the
            // single-threaded monitor, no thread started yet): nothing reads
            // the environment meanwhile.
            unsafe { std::env::remove_var(name) };
        }
        for (name, value) in AGENT_ENV {
            // SAFETY: as above.
            unsafe { std::env::set_var(name, value) };
        }
        std::process::exit(i32::from((self.serve)(LISTEN_FD)))
    }
}

/// Writes `args` over this process's command line (the area
/// `/proc/PID/cmdline` reads), padded with NULs, cut if longer.
fn show_command_line(args: &[CString]) -> std::io::Result<()> {
    let bad = || std::io::Error::other("no argument area in /proc/self/stat");
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // After the command name (in parentheses, which it may itself hold),
    // the fields from the 3rd on; the argument area is the 48th and 49th.
    let fields: Vec<&str> = stat.rsplit_once(')').ok_or_else(bad)?.1.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<usize>().ok()).ok_or_else(bad);
    let (start, end) = (field(48)?, field(49)?);
    let len = end.checked_sub(start).filter(|len| *len > 0).ok_or_else(bad)?;
    let mut text: Vec<u8> = args.iter().flat_map(|a| a.as_bytes_with_nul()).copied().collect();
    text.resize(len, 0);
    if let Some(last) = text.last_mut() {
        *last = 0;
    }
    // SAFETY: [start, end) is this process's argument area, the strings
    // the kernel copied onto its first stack at exec: mapped writable, and
    // read from here on only through /proc (std's copy of argv points into
    // it, and nothing in this process reads the arguments again).
    unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), std::ptr::with_exposed_provenance_mut(start), len) };
    Ok(())
}

/// Where glibc keeps a thread's kernel tid: `struct pthread`'s `tid`, at
/// this offset from the thread's descriptor on x86-64 (glibc's own code
/// reads it as `%fs:0x2d0`; the same since glibc 2.26).
#[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
const GLIBC_TID_OFFSET: usize = 0x2d0;

/// The calling thread's tid slot in glibc's descriptor, if it holds the
/// tid the kernel gives this thread: the layout is checked, not assumed.
#[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
fn glibc_tid_slot() -> Option<*mut libc::pid_t> {
    let tid = nix::unistd::gettid().as_raw();
    // SAFETY: pthread_self has no preconditions.
    let descriptor = usize::try_from(unsafe { libc::pthread_self() }).ok()?;
    // SAFETY: pthread_self is the address of this thread's descriptor, a
    // glibc object of some 2 KiB, alive as long as the thread; the slot is
    // an aligned pid_t inside it, read as plain memory whatever it holds.
    let slot =
        unsafe { std::ptr::with_exposed_provenance_mut::<u8>(descriptor).add(GLIBC_TID_OFFSET).cast::<libc::pid_t>() };
    // SAFETY: as above.
    (unsafe { slot.read() } == tid).then_some(slot)
}

#[cfg(not(all(target_arch = "x86_64", target_env = "gnu")))]
fn glibc_tid_slot() -> Option<*mut libc::pid_t> {
    None
}

/// The init's stack: as large as a main thread's (the agent's main thread
/// runs on it when it serves in place), mapped lazily so that only the
/// pages used are ever made, with a guard page below it.
struct InitStack {
    base: *mut libc::c_void,
}

impl InitStack {
    const LEN: usize = 8 << 20;
    const GUARD: usize = 4096;

    fn new() -> std::io::Result<Self> {
        let (prot, flags) = (
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_STACK,
        );
        // SAFETY: a new anonymous mapping, owned by the value returned.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), Self::LEN, prot, flags, -1, 0) };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let stack = Self { base };
        // SAFETY: the lowest page of the mapping just made, owned here.
        if unsafe { libc::mprotect(base, Self::GUARD, libc::PROT_NONE) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// The stack's top (it grows down), page-aligned.
    fn top(&self) -> *mut libc::c_void {
        self.base.wrapping_byte_add(Self::LEN)
    }
}

impl Drop for InitStack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, used by nothing of this
        // process once the clone has its own copy.
        unsafe { libc::munmap(self.base, Self::LEN) };
    }
}

/// Clones the sandbox's init into the namespaces `flags` makes, running
/// `init` on `stack`. With `tid_slot` ([`glibc_tid_slot`]), the kernel
/// writes the child's tid there in the child, as glibc's own `fork` does
/// for its children: glibc then knows the child's thread as itself
/// (locks that record their owner, signals to itself), and the child may
/// go on as any program, not only set up and exec.
fn clone_init(
    init: &mut dyn FnMut() -> libc::c_int,
    stack: &InitStack,
    flags: CloneFlags,
    tid_slot: Option<*mut libc::pid_t>,
) -> nix::Result<Pid> {
    extern "C" fn entry(arg: *mut libc::c_void) -> libc::c_int {
        // SAFETY: `arg` is the `&mut &mut dyn FnMut` passed to clone
        // below, in the child's copy of its parent's memory: the child
        // never returns to the frame that holds it.
        let init = unsafe { &mut *arg.cast::<&mut dyn FnMut() -> libc::c_int>() };
        init()
    }
    let mut init = init;
    let mut flags = flags.bits() | libc::SIGCHLD;
    let child_tid = match tid_slot {
        Some(slot) => {
            flags |= libc::CLONE_CHILD_SETTID;
            slot
        }
        None => std::ptr::null_mut(),
    };
    // SAFETY: the process is single-threaded (the caller's contract), so
    // the child, a copy of it on `stack`, holds no lock another thread
    // owned; `init` and `stack` outlive the call, and the child has its
    // own copy of both (no CLONE_VM). `child_tid` is this thread's tid
    // slot, in the child's copy.
    let pid = unsafe {
        libc::clone(
            entry,
            stack.top(),
            flags,
            (&raw mut init).cast(),
            std::ptr::null_mut::<libc::pid_t>(),
            std::ptr::null_mut::<libc::c_void>(),
            child_tid,
        )
    };
    nix::errno::Errno::result(pid).map(Pid::from_raw)
}

fn c(s: &str) -> CString {
    // Inputs are our own constants, without NUL bytes.
    CString::new(s.replace('\0', "")).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_lines_are_read_whole_or_not_at_all() {
        assert_eq!(
            Split::parse("split /sys/fs/cgroup/moat/sbx-1 1000 896"),
            Some(Split { dir: "/sys/fs/cgroup/moat/sbx-1".into(), user_memory: 1000, user_pids: 896 })
        );
        assert_eq!(Split::parse("split relative 1 2"), None);
        assert_eq!(Split::parse("split /x 1"), None);
        assert_eq!(Split::parse("user unified /sys/fs/cgroup/moat/sbx-1/user"), None);
        assert_eq!(parse_user_cgroup("split /sys/fs/cgroup/moat/sbx-1 1 2"), None);
    }

    #[test]
    fn user_cgroup_lines_are_told_from_procs_paths() {
        assert_eq!(
            parse_user_cgroup("user pids /sys/fs/cgroup/pids/moat/sbx-1/user"),
            Some(("pids".into(), PathBuf::from("/sys/fs/cgroup/pids/moat/sbx-1/user")))
        );
        assert_eq!(parse_user_cgroup("/sys/fs/cgroup/pids/moat/sbx-1/agent/cgroup.procs"), None);
        assert_eq!(parse_user_cgroup("user ../x /tmp"), None, "a controller name is one plain word");
        assert_eq!(parse_user_cgroup("user pids relative"), None);
    }

    /// A pasta that fails to start (as Debian's does when `/dev/net/tun` is
    /// mode 0600) is reported with its own words and where to look next,
    /// not only with its exit status.
    #[test]
    fn a_failing_pasta_is_quoted_in_the_error() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: a network namespace needs root");
            return;
        }
        let dir = tempfile::tempdir().expect("a temporary directory");
        let fake = dir.path().join("pasta");
        let script = "#!/bin/sh\necho 'Failed to open tun socket in namespace: Permission denied' >&2\nexit 1\n";
        std::fs::write(&fake, script).expect("the fake pasta");
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        // A network namespace without a default route, as a new jail's.
        let mut holder = std::process::Command::new("unshare")
            .args(["--net", "sleep", "30"])
            .spawn()
            .expect("unshare (util-linux) starts");
        let pid = Pid::from_raw(i32::try_from(holder.id()).expect("a pid fits"));
        let ours = std::fs::read_link("/proc/self/ns/net").expect("our network namespace");
        let started = std::time::Instant::now();
        while std::fs::read_link(format!("/proc/{pid}/ns/net")).is_ok_and(|ns| ns == ours)
            && started.elapsed() < std::time::Duration::from_secs(5)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let result = start_pasta(&fake, pid, 0, &dir.path().join(PASTA_LOG));
        let _ = holder.kill();
        let _ = holder.wait();
        let said = result.map(drop).expect_err("the fake pasta fails").source.to_string();
        for words in ["pasta exited (exit status: 1)", "Failed to open tun socket in namespace", "moat doctor"] {
            assert!(said.contains(words), "{words:?} missing from: {said}");
        }
    }
}
