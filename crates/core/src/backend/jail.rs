//! The jail backend, host side: starts `moat-agent jail` (the monitor that
//! builds the namespaces; see `moat_agent::jail`), waits for the agent to
//! answer, and stops, freezes and removes sandboxes.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use moat_proto::{AgentClient, UnixConnector};

use crate::backend::{Backend, BackendKind, Instance};
use crate::cgroup::{Cgroup, CgroupSupport, Limits, Sweeper};
use crate::error::{CreateError, IoError};
use crate::hostuser::HostUser;
use crate::image::{Image, JAIL_ID_BASE, JAIL_ID_COUNT};
use crate::process::{Exited, Pidfd};
use crate::sandbox::SandboxSpec;
use crate::state::StateDir;

/// How long a jail may take to answer its first handshake. A guard against
/// a wedged start, far above the milliseconds a start takes.
const START_GUARD: Duration = Duration::from_secs(30);

/// How long a jail whose start failed has to exit, so that the error
/// can say how it ended.
const EXIT_GUARD: Duration = Duration::from_secs(1);

/// How long a monitor asked to stop (SIGTERM) has before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Processes one sandbox may run at once.
const PIDS_MAX: u32 = 1024;

/// Starts jails.
#[derive(Debug, Clone)]
pub struct JailBackend {
    /// A monitor started ahead of the next create.
    spare: Arc<Spares>,
    agent: PathBuf,
    cgroups: CgroupSupport,
    /// Who starts the jails: root maps a leased range from [`JAIL_ID_BASE`] up (`ids`), anyone else its
    /// subordinate ranges (rootless).
    user: HostUser,
}

/// A running jail.
#[derive(Debug)]
pub struct Jail {
    id: String,
    monitor: Child,
    /// Readable once `monitor` has ended.
    exit: Pidfd,
    state: Option<StateDir>,
    /// Shared with its power switch, which only freezes and thaws it.
    cgroup: Option<Arc<Cgroup>>,
    socket: PathBuf,
    /// Root's lease of the jail's host ids (see `ids`), released after
    /// [`Jail::stop`], once nothing of the jail runs as them.
    ids: Option<super::ids::Lease>,
}

impl JailBackend {
    pub fn new(agent: PathBuf) -> Self {
        // A rootless moat on cgroup v2 finds (and moves into) its delegated
        // cgroup before it has children to share it with.
        crate::cgroup::prepare();
        // The first create's monitor starts now, beside the rest of the
        // host's start (configuration, image, state directory).
        let spare = Arc::new(Spares::default());
        spare.start(&agent);
        Self { agent, cgroups: CgroupSupport::probe(), user: HostUser::current(), spare }
    }

    pub fn cgroups(&self) -> &CgroupSupport {
        &self.cgroups
    }
}

/// A monitor's command line, given to a new process or to a spare.
#[derive(Debug, Default)]
struct MonitorArgs(Vec<OsString>);

impl MonitorArgs {
    fn arg(&mut self, arg: impl Into<OsString>) -> &mut Self {
        self.0.push(arg.into());
        self
    }

    fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(&mut self, args: I) -> &mut Self {
        self.0.extend(args.into_iter().map(Into::into));
        self
    }

    /// A new monitor with these arguments, its errors written to `log`.
    fn spawn(&self, agent: &Path, log: std::fs::File) -> std::io::Result<Child> {
        let mut command = monitor_command(agent);
        command.args(&self.0).stderr(log);
        command.spawn()
    }
}

/// `agent` as a monitor runs: an environment of moat's own, stdin for the
/// cgroups to join, stdout for its readiness, and a process group of its
/// own (a terminal's Ctrl-C reaches the host process, which then destroys
/// the sandbox in order).
fn monitor_command(agent: &Path) -> Command {
    let mut command = Command::new(agent);
    command.env_clear().envs(crate::process::helper_env());
    command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    command
}

/// The monitor of the next jail, started ahead (`moat-agent jail-spare`):
/// it execs and starts (its program is mapped and relocated, glibc probes
/// the CPU, some 0.5 ms) while the host does the rest of a create, and
/// waits for its arguments on stdin. A backend keeps one once it has made
/// more than one jail (a server); the one it starts with is the first
/// create's (`moat run`'s only one), none more. A spare that is not taken
/// is killed with the backend; one whose host dies reads the end of its
/// stdin and exits.
#[derive(Debug, Default)]
struct Spares {
    inner: std::sync::Mutex<SparesState>,
}

#[derive(Debug, Default)]
struct SparesState {
    ready: Option<Spare>,
    /// Creates seen, spare or not.
    creates: u64,
}

impl Spares {
    fn lock(&self) -> std::sync::MutexGuard<'_, SparesState> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn start(&self, agent: &Path) {
        if agent.is_file() {
            let started = Spare::start(agent);
            self.lock().ready = started.ok();
        }
    }

    /// The spare, if one is ready; it counts a create.
    fn take(&self) -> Option<Spare> {
        let mut spares = self.lock();
        spares.creates += 1;
        spares.ready.take()
    }

    /// Starts the next spare, once a second create has been seen.
    fn refill(&self, agent: &Path) {
        let wanted = {
            let spares = self.lock();
            spares.ready.is_none() && spares.creates >= 2
        };
        // Another create's refill may have kept one first: this one is
        // then killed as it drops.
        if wanted && let Ok(spare) = Spare::start(agent) {
            self.lock().ready.get_or_insert(spare);
        }
    }
}

#[derive(Debug)]
struct Spare(Option<Child>);

impl Spare {
    fn start(agent: &Path) -> std::io::Result<Self> {
        let mut command = monitor_command(agent);
        // The sandbox's init serves as the agent in this process and shows
        // the agent's command line in the place of this one's, cut to its
        // length (see `moat_agent::jail`): room for it, whatever the
        // agent's path is.
        command.arg(SPARE_SUBCOMMAND).arg(ARGV_ROOM);
        command.spawn().map(|child| Self(Some(child)))
    }

    /// Becomes the monitor `args` describe: they go on its stdin, counted
    /// and NUL-separated (host paths are bytes, never NUL); the cgroups
    /// follow there later. An error if it has ended.
    fn hand(mut self, args: &MonitorArgs) -> std::io::Result<Child> {
        use std::io::Write;
        use std::os::unix::ffi::OsStrExt;
        let mut child = self.0.take().ok_or_else(|| std::io::Error::other("no spare"))?;
        if !matches!(child.try_wait(), Ok(None)) {
            return Err(std::io::Error::other("the spare monitor ended"));
        }
        let mut message = format!("{}\0", args.0.len()).into_bytes();
        for arg in &args.0 {
            message.extend_from_slice(arg.as_bytes());
            message.push(0);
        }
        let written =
            child.stdin.as_mut().ok_or_else(|| std::io::Error::other("no stdin")).and_then(|s| s.write_all(&message));
        if let Err(e) = written {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        Ok(child)
    }
}

impl Drop for Spare {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The agent's subcommand of a spare monitor (`moat-agent jail-spare`).
pub const SPARE_SUBCOMMAND: &str = "jail-spare";

/// A spare's second argument, which it ignores: the room its command line
/// keeps for the agent's (`/.moat/agent --listen fd:3 --log-level warn`,
/// 44 bytes with its NULs).
const ARGV_ROOM: &str = "room-for-the-agents-command-line------------------------------";

/// The agent's socket, relative to the state directory (as the launcher
/// in `moat_agent::jail` binds it).
fn moat_agent_socket() -> &'static str {
    "sock/agent.sock"
}

/// Reads the monitor's readiness line (`moat_agent::jail::READY`) from its
/// stdout; an error says what came instead.
async fn read_ready(stdout: std::process::ChildStdout) -> Result<(), String> {
    use tokio::io::AsyncReadExt;
    let mut pipe = tokio::net::unix::pipe::Receiver::from_owned_fd(stdout.into())
        .map_err(|e| format!("cannot read the monitor's readiness: {e}"))?;
    let mut line = Vec::with_capacity(READY.len());
    let mut byte = [0u8; 1];
    // Byte by byte: nothing past the line is ever read, and it is short.
    while line.last() != Some(&b'\n') && line.len() < READY.len() {
        match pipe.read(&mut byte).await {
            Ok(0) => break,
            Ok(_) => line.push(byte[0]),
            Err(e) => return Err(format!("cannot read the monitor's readiness: {e}")),
        }
    }
    if line == READY.as_bytes() { Ok(()) } else { Err("the jail's monitor ended before its sandbox started".into()) }
}

/// The line the monitor writes when the sandbox's socket takes connections
/// (`moat_agent::jail::READY`; moat-core does not depend on the agent crate).
const READY: &str = "ready\n";

/// Where a rootless user's namespace holder serves, in the data directory.
pub const USERNS_SOCKET: &str = "userns.sock";

/// The default of `MOAT_USERNS_HOLD_SECS`.
pub const DEFAULT_USERNS_HOLD_SECS: u64 = 60;

/// `MOAT_USERNS_HOLD_SECS`: how long a rootless user's namespace holder
/// waits for the next jail before it ends; 0 starts none (every jail maps
/// its own with newuidmap and newgidmap). An error says what is allowed.
pub fn userns_hold_secs(text: Option<&str>) -> Result<u64, String> {
    match text.map(str::trim) {
        None | Some("") => Ok(DEFAULT_USERNS_HOLD_SECS),
        Some(t) => t.parse::<u64>().ok().filter(|s| *s <= 86_400).ok_or_else(|| {
            format!(
                "MOAT_USERNS_HOLD_SECS={t:?} is not a number of seconds from 0 (no holder) to 86400; the default \
                 is {DEFAULT_USERNS_HOLD_SECS}"
            )
        }),
    }
}

/// The arguments that give a rootless `moat-agent` (a jail's monitor, the
/// cgroup sweeper) the user's subordinate gids and namespace holder.
fn userns_args(gids: crate::hostuser::Range, data_dir: &Path) -> Result<Vec<OsString>, String> {
    let mut args: Vec<OsString> = vec!["--gid-base".into(), gids.start.to_string().into()];
    let hold = userns_hold_secs(std::env::var("MOAT_USERNS_HOLD_SECS").ok().as_deref())?;
    let socket = data_dir.join(USERNS_SOCKET);
    // A socket's path has at most 107 bytes; a longer data directory only
    // goes without a holder.
    if hold > 0 && socket.as_os_str().len() < 108 {
        args.extend(["--userns-holder".into(), socket.into(), "--userns-hold-secs".into(), hold.to_string().into()]);
    }
    Ok(args)
}

/// The cgroup sweeper of `user`'s sandboxes in `data_dir`, run as `agent`:
/// `None` for root (who may remove every cgroup) and for a user with no
/// subordinate ids (who has no rootless jails).
pub fn sweeper_for(agent: &Path, user: &HostUser, data_dir: &Path) -> Result<Option<Sweeper>, String> {
    let Some((uids, gids)) = user.ids.filter(|_| !user.is_root()) else { return Ok(None) };
    Ok(Some(Sweeper::new(agent.to_path_buf(), sweeper_args(uids, userns_args(gids, data_dir)?))))
}

/// The sweeper's arguments: the user's uids, then `userns`.
fn sweeper_args(uids: crate::hostuser::Range, userns: Vec<OsString>) -> Vec<OsString> {
    let mut args: Vec<OsString> =
        vec!["--id-base".into(), uids.start.to_string().into(), "--id-count".into(), JAIL_ID_COUNT.to_string().into()];
    args.extend(userns);
    args
}

/// The `pasta` binary (Debian package `passt`), if installed.
pub fn find_pasta() -> Option<PathBuf> {
    crate::programs::find_program("pasta")
}

/// The tun device pasta opens inside an `open` jail's network namespace.
pub const TUN: &str = "/dev/net/tun";

/// What keeps pasta (network `open` on jails) from opening [`TUN`], with
/// the command that fixes it; `None` when nothing does. pasta runs as the
/// uid of the sandbox's root (the first of its range, from [`JAIL_ID_BASE`] up), which owns nothing on the
/// host: the device must be readable and writable by every user, as
/// distributions create it (mode 0666).
pub fn tun_problem() -> Option<String> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let found = std::fs::metadata(TUN).map(|m| (m.file_type().is_char_device(), m.permissions().mode()));
    if let Some(problem) = describe_tun(found) {
        return Some(problem);
    }
    match std::fs::OpenOptions::new().read(true).write(true).open(TUN) {
        Ok(_) => None,
        Err(e) => Some(format!(
            "{TUN} cannot be opened by this user ({e}); as root, run `chmod 0666 {TUN}`, \
             or check that the tun module is loaded (`modprobe tun`)"
        )),
    }
}

/// [`tun_problem`]'s verdict on what `stat` found: (character device?, mode).
fn describe_tun(found: std::io::Result<(bool, u32)>) -> Option<String> {
    let create = format!("`mkdir -p /dev/net && mknod -m 0666 {TUN} c 10 200`");
    match found {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Some(format!("{TUN} does not exist: load the tun module (`modprobe tun`) or, as root, create it: {create}"))
        }
        Err(e) => Some(format!("{TUN} cannot be examined ({e}); as root, run `ls -l {TUN}` to see why")),
        Ok((false, _)) => Some(format!("{TUN} is not a character device: as root, remove it and run {create}")),
        Ok((true, mode)) if mode & 0o006 != 0o006 => Some(format!(
            "{TUN} is mode {:04o}: pasta runs as the sandbox root's uid (from {JAIL_ID_BASE} up) and cannot open it; \
             as root, run `chmod 0666 {TUN}` (its usual mode)",
            mode & 0o7777
        )),
        Ok(_) => None,
    }
}

impl Backend for JailBackend {
    type Instance = Jail;

    fn kind(&self) -> BackendKind {
        BackendKind::Jail
    }

    /// Creates a jail from `image` and waits until its agent answers.
    async fn start(
        &self,
        id: &str,
        hostname: &str,
        spec: &SandboxSpec,
        image: &Image,
        data_dir: &Path,
    ) -> Result<Jail, CreateError> {
        let io = |what: &str| {
            let (id, what) = (id.to_owned(), what.to_owned());
            move |source| IoError { id, what, source }
        };
        let pasta = match spec.network {
            crate::sandbox::NetworkPolicy::Open => Some(find_pasta().ok_or_else(|| {
                CreateError::StartFailed {
                    id: id.into(),
                    reason: "network open needs pasta, from Debian's passt package (apt-get install passt); \
                         or use network filtered"
                        .into(),
                }
            })?),
            _ => None,
        };
        let refused = |reason: String| CreateError::StartFailed { id: id.into(), reason };
        if let Some(problem) = self.user.jail_problem() {
            return Err(refused(problem));
        }
        let root = crate::hostuser::Range { start: JAIL_ID_BASE, count: JAIL_ID_COUNT };
        let (mut uids, gids) = self.user.ids.unwrap_or((root, root));
        if image.manifest.jail_id_base != uids.start {
            let name = self.user.display_name();
            return Err(refused(format!(
                "image {:?} is owned for jails that map host ids from {}, and {name}'s jails map its \
                 subordinate ids from {}: build it in that range as {name} with `moat image build --name {}`, \
                 or as root run `moat setup --user {name}`, which copies root's image into {name}'s data \
                 directory with its files' owners in that range",
                image.name, image.manifest.jail_id_base, uids.start, image.name
            )));
        }
        // Root's jails each map a range of their own (see `ids`); the
        // image's files stay owned from range 0 and the monitor shows them
        // in the jail's through an idmapped mount.
        let lease = if self.user.is_root() {
            let lease = super::ids::lease(&image.path("rootfs")).map_err(refused)?;
            uids = lease.range;
            Some(lease)
        } else {
            None
        };
        let state = StateDir::create(data_dir, id).map_err(io("creating its state directory"))?;
        // Disk writes live in a tmpfs charged to the sandbox's memory: the
        // memory limit covers both.
        let limits = Limits { memory_bytes: (spec.memory_mib + spec.disk_mib) << 20, pids: PIDS_MAX, cpus: spec.cpus };
        let log_path = state.path.join("jail.log");
        let log = std::fs::File::create(&log_path).map_err(io("creating its log"))?;
        let mut command = MonitorArgs::default();
        command
            .arg("jail")
            .arg("--rootfs")
            .arg(image.path("rootfs"))
            .arg("--state")
            .arg(&state.path)
            .arg("--agent")
            .arg(&self.agent)
            .args(["--hostname", hostname, "--id-base", &uids.start.to_string()])
            .args(["--id-count", &JAIL_ID_COUNT.to_string(), "--disk-mib", &spec.disk_mib.to_string()]);
        if uids.start != image.manifest.jail_id_base {
            command.args(["--image-id-base", &image.manifest.jail_id_base.to_string()]);
        }
        let sweeper = if self.user.is_root() {
            None
        } else {
            // The monitor enters a user namespace of the caller's own
            // first (newuidmap, newgidmap, or the holder that keeps one
            // mapped: moat_agent::userns_holder) and builds the jail from
            // there. The cgroup sweeper enters the same.
            let userns = userns_args(gids, data_dir).map_err(refused)?;
            command.arg("--rootless").args(&userns);
            Some(Arc::new(Sweeper::new(self.agent.clone(), sweeper_args(uids, userns))))
        };
        if let Some(pasta) = &pasta {
            command.arg("--pasta").arg(pasta);
        }
        // The cgroups to join come on stdin, made while the monitor builds the
        // root file system: the two overlap instead of adding up.
        command.arg("--cgroups-on-stdin");
        // Readiness comes as a line on stdout: waited on, never polled.
        command.arg("--ready-on-stdout");
        let mut monitor = match self.spare.take() {
            // A monitor started ahead: it writes its own log.
            Some(spare) => match spare.hand(command.arg("--log").arg(&log_path)) {
                Ok(monitor) => monitor,
                Err(_) => command.spawn(&self.agent, log).map_err(io(&format!("starting {}", self.agent.display())))?,
            },
            None => command.spawn(&self.agent, log).map_err(io(&format!("starting {}", self.agent.display())))?,
        };
        let exit = match Pidfd::of(&monitor) {
            Ok(exit) => exit,
            Err(e) => {
                let _ = monitor.kill();
                let _ = monitor.wait();
                state.remove();
                return Err(IoError {
                    id: id.into(),
                    what: "watching its monitor (pidfd_open needs Linux 5.3)".into(),
                    source: e,
                }
                .into());
            }
        };
        state.record_monitor(monitor.id()).map_err(io("recording its monitor"))?;
        let cgroup = match Cgroup::create(&self.cgroups, id, limits, self.user.is_root().then_some(uids.start)) {
            Ok(Some(cgroup)) => Some(Arc::new(cgroup.with_sweeper(sweeper.clone()))),
            Ok(None) if crate::limits::allow_unlimited() => None,
            Ok(None) => return Err(self.unlimited_refused(id, monitor, state, "this host has no cgroups")),
            // Another's cgroup of the same id: not run in, nor removed.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let _ = monitor.kill();
                let _ = monitor.wait();
                state.remove();
                return Err(CreateError::StartFailed { id: id.into(), reason: e.to_string() });
            }
            Err(e) if crate::limits::allow_unlimited() => {
                tracing::warn!(%id, "running without cgroup limits (MOAT_ALLOW_UNLIMITED=1): {e}");
                Cgroup::remove_leftovers(id, sweeper.as_deref());
                None
            }
            Err(e) => {
                Cgroup::remove_leftovers(id, sweeper.as_deref());
                return Err(self.unlimited_refused(id, monitor, state, &e.to_string()));
            }
        };
        let mut procs: String =
            cgroup.iter().flat_map(|c| c.procs_files()).map(|p| format!("{}\n", p.display())).collect();
        // The `user` cgroups the monitor binds into the sandbox for the agent.
        for (name, dir) in cgroup.iter().flat_map(|c| c.user_dirs()) {
            procs.push_str(&format!("user {name} {}\n", dir.display()));
        }
        if let Some(split) = cgroup.as_ref().and_then(|c| c.split_line(limits)) {
            procs.push_str(&split);
            procs.push('\n');
        }
        procs.push('\n');
        if let Some(mut stdin) = monitor.stdin.take() {
            use std::io::Write;
            // A monitor that already died shows in wait_ready, with its log.
            let _ = stdin.write_all(procs.as_bytes());
        }
        // The next create's monitor starts while this one builds its jail.
        self.spare.refill(&self.agent);
        let socket = state.path.join(moat_agent_socket());
        let ready = monitor.stdout.take();
        let mut jail = Jail { id: id.into(), monitor, exit, state: Some(state), cgroup, socket, ids: lease };
        let started = match ready {
            Some(ready) => jail.wait_ready(ready).await,
            None => Err(jail.start_failed("its monitor has no stdout")),
        };
        if let Err(e) = started {
            // Stopping blocks (it waits for processes to die): not on an async thread.
            let _ = tokio::task::spawn_blocking(move || jail.stop()).await;
            // pasta's own words are in the log; say also what on the host stops it.
            return Err(match (e, pasta.as_ref().and_then(|_| tun_problem())) {
                (CreateError::StartFailed { id, reason }, Some(problem)) => {
                    CreateError::StartFailed { id, reason: format!("{reason}\n{problem}") }
                }
                (e, _) => e,
            });
        }
        Ok(jail)
    }
}

impl JailBackend {
    /// Stops a monitor started for a jail whose cgroups could not be made,
    /// and says why the jail is refused and what allows it.
    fn unlimited_refused(&self, id: &str, mut monitor: Child, state: StateDir, why: &str) -> CreateError {
        let _ = monitor.kill();
        let _ = monitor.wait();
        state.remove();
        CreateError::StartFailed {
            id: id.into(),
            reason: format!(
                "its cgroups (memory, pids and CPU limits) cannot be set up: {why}. Without them a sandbox \
                 could exhaust the host's memory and processes. Run moat as root or with a delegated cgroup \
                 (`moat doctor` says what this host offers), or set MOAT_ALLOW_UNLIMITED=1 to run sandboxes \
                 without limits"
            ),
        }
    }
}

impl Instance for Jail {
    fn client(&self) -> AgentClient<UnixConnector> {
        AgentClient::unix(&self.socket)
    }

    fn power_switch(&self) -> Option<super::PowerSwitch> {
        let cgroup = self.cgroup.clone().filter(|cgroup| cgroup.can_freeze())?;
        let id = self.id.clone();
        Some(Arc::new(move |suspended| {
            cgroup.set_frozen(suspended).map_err(|source| IoError {
                id: id.clone(),
                what: if suspended { "freezing".into() } else { "thawing".into() },
                source,
            })
        }))
    }

    fn destroy(&mut self) {
        self.stop();
    }

    fn host_pid(&self) -> u32 {
        self.monitor.id()
    }

    fn exit_watch(&self) -> std::io::Result<Pidfd> {
        self.exit.try_clone()
    }

    fn ended(&mut self) -> Option<String> {
        let status = self.monitor.try_wait().ok()??;
        // The monitor ends as the sandbox's init (the agent) ended: 128 + a
        // signal's number when it was killed.
        let how = match status.code() {
            Some(code) if code > 128 => format!("its agent was killed by signal {}", code - 128),
            Some(code) => format!("its agent exited with status {code}"),
            None => format!("its jail's monitor was killed ({status})"),
        };
        Some(format!("the sandbox's processes ended unexpectedly: {how}"))
    }
}

impl Jail {
    /// Waits, by events only, until the agent answers a handshake: the
    /// monitor's line on `ready` (its socket then takes connections, held in
    /// the backlog until the agent accepts), then the handshake itself;
    /// meanwhile the monitor's pidfd tells of a jail that died, and
    /// [`START_GUARD`] bounds the whole.
    async fn wait_ready(&mut self, ready: std::process::ChildStdout) -> Result<(), CreateError> {
        let watch = || {
            self.exit.try_clone().map_err(|source| IoError {
                id: self.id.clone(),
                what: "watching its monitor".into(),
                source,
            })
        };
        let (exited, ended) = (watch()?, watch()?);
        let client = self.client();
        let answered = async {
            read_ready(ready).await?;
            client.info().await.map(drop).map_err(|e| format!("the agent did not answer: {e}"))
        };
        let died = async {
            // Without a reactor registration, the handshake's own failure
            // and the guard still end the wait.
            if exited.exited().await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        let outcome = tokio::select! {
            outcome = tokio::time::timeout(START_GUARD, answered) => outcome,
            () = died => Ok(Err("the jail's monitor exited".into())),
        };
        match outcome {
            Ok(Ok(())) => Ok(()),
            Err(_) => Err(self.start_failed("the agent did not answer within 30 s")),
            Ok(Err(why)) => {
                // A monitor that failed exits: say how, with its log.
                if let Ok(Ok(())) = tokio::time::timeout(EXIT_GUARD, ended.exited()).await
                    && let Ok(Some(status)) = self.monitor.try_wait()
                {
                    return Err(self.start_failed(&format!("the jail exited ({status})")));
                }
                Err(self.start_failed(&why))
            }
        }
    }

    fn start_failed(&self, what: &str) -> CreateError {
        let log =
            self.state.as_ref().and_then(|s| std::fs::read_to_string(s.path.join("jail.log")).ok()).unwrap_or_default();
        let tail: Vec<_> = log.lines().rev().take(10).collect();
        let tail: Vec<_> = tail.into_iter().rev().collect();
        CreateError::StartFailed { id: self.id.clone(), reason: format!("{what}; its log says:\n{}", tail.join("\n")) }
    }

    /// Kills the jail (its monitor takes PID 1 and the whole pid namespace
    /// along), then removes its cgroup and state directory.
    fn stop(&mut self) {
        if let Some(cgroup) = &self.cgroup {
            // A frozen process cannot die until thawed.
            let _ = cgroup.set_frozen(false);
        }
        // SIGTERM: the monitor kills and reaps the sandbox's init, whose
        // death takes the pid namespace along, then exits. SIGKILL if not.
        if let Ok(None) = self.monitor.try_wait() {
            let pid = nix::unistd::Pid::from_raw(i32::try_from(self.monitor.id()).unwrap_or(i32::MAX));
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            if !self.exit.wait_timeout(STOP_GRACE) {
                let _ = self.monitor.kill();
            }
        }
        let _ = self.monitor.wait();
        // The state directory goes beside the cgroups: its removal waits
        // mostly on the disk (each freed block of a file system mounted
        // with `discard` is a request to the device), theirs on the kernel.
        let (cgroup, state) = (self.cgroup.take(), self.state.take());
        let emptied = std::thread::scope(|scope| {
            if let Some(state) = state {
                scope.spawn(|| state.remove());
            }
            cgroup.is_some_and(|cgroup| cgroup.remove())
        });
        // A range is handed to the next jail only once nothing runs as it:
        // the cgroups held every process of the jail (pasta's too); without
        // them, or with some left, the host's processes are looked at.
        if !emptied && let Some(lease) = self.ids.take() {
            lease.release_if_unused();
        }
    }
}

impl Drop for Jail {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for the agent: a spare that writes what it is handed to
    /// `out` and ends with its stdin.
    fn fake_agent(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let agent = dir.join("agent");
        let out = dir.join("handed");
        std::fs::write(&agent, format!("#!/bin/sh\n[ \"$1\" = {SPARE_SUBCOMMAND} ] && exec cat > {}\n", out.display()))
            .expect("write");
        std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        agent
    }

    fn alive(pid: u32) -> bool {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")), None).is_ok()
    }

    /// The first create takes the spare its backend started with, and
    /// none is started after it (`moat run` makes one jail); from the
    /// second create on, one is kept ready. A spare is handed its
    /// arguments counted and NUL-separated, bytes as they are; one not
    /// taken goes with its backend.
    #[test]
    fn a_spare_monitor_is_kept_for_a_server_and_handed_its_arguments() {
        use std::io::Read;
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let agent = fake_agent(dir.path());
        let spares = Spares::default();
        spares.start(&agent);
        let first = spares.take().expect("started with the backend");
        spares.refill(&agent);
        assert!(spares.lock().ready.is_none(), "no spare after the first create");
        let mut args = MonitorArgs::default();
        args.arg("jail").arg(std::ffi::OsStr::from_bytes(b"--state=/x\xff\ny"));
        let mut monitor = first.hand(&args).expect("handed");
        drop(monitor.stdin.take());
        assert!(monitor.wait().expect("waits").success());
        let mut handed = Vec::new();
        std::fs::File::open(dir.path().join("handed")).expect("open").read_to_end(&mut handed).expect("read");
        assert_eq!(handed, b"2\0jail\0--state=/x\xff\ny\0");
        assert!(spares.take().is_none(), "none ready for the second create");
        spares.refill(&agent);
        let pid = spares.lock().ready.as_ref().and_then(|s| s.0.as_ref()).map(Child::id).expect("kept for the third");
        assert!(alive(pid));
        drop(spares);
        assert!(!alive(pid), "a spare not taken goes with its backend");
        // One that ended is not handed anything: the create starts its own.
        // A spare's command line has room for the agent's, which the
        // sandbox's init writes over it, whatever the agent's path.
        let agent_line = "/.moat/agent\0--listen\0fd:3\0--log-level\0warn\0";
        assert!(SPARE_SUBCOMMAND.len() + ARGV_ROOM.len() + 2 >= agent_line.len());
        let mut ended = Spare::start(Path::new("/bin/true")).expect("starts");
        ended.0.as_mut().expect("a child").wait().expect("ends");
        assert!(ended.hand(&args).is_err());
    }

    #[test]
    fn a_tun_device_pasta_cannot_open_is_explained_with_its_fix() {
        let private = describe_tun(Ok((true, 0o20600))).expect("mode 0600 is a problem");
        assert!(private.contains("mode 0600") && private.contains("chmod 0666 /dev/net/tun"), "{private}");
        let missing = describe_tun(Err(std::io::ErrorKind::NotFound.into())).expect("a missing device is a problem");
        assert!(missing.contains("modprobe tun") && missing.contains("mknod"), "{missing}");
        assert!(describe_tun(Ok((false, 0o100666))).is_some(), "a regular file is not the device");
        assert_eq!(describe_tun(Ok((true, 0o20666))), None);
    }

    #[test]
    fn the_holder_setting_is_read_or_refused_with_what_is_allowed() {
        assert_eq!(userns_hold_secs(None), Ok(DEFAULT_USERNS_HOLD_SECS));
        assert_eq!(userns_hold_secs(Some(" ")), Ok(DEFAULT_USERNS_HOLD_SECS));
        assert_eq!(userns_hold_secs(Some("0")), Ok(0));
        assert_eq!(userns_hold_secs(Some(" 600 ")), Ok(600));
        for bad in ["-1", "1.5", "forever", "86401"] {
            let why = userns_hold_secs(Some(bad)).expect_err(bad);
            assert!(why.contains("MOAT_USERNS_HOLD_SECS") && why.contains("0 (no holder) to 86400"), "{why}");
        }
    }
}
