//! One cgroup per command, beneath the sandbox's `user` cgroup.
//!
//! The host splits a sandbox's cgroup in two: `agent`, which holds this
//! agent, and `user`, which holds every process the agent starts and whose
//! limits are the sandbox's minus a reserve. The jail monitor binds the
//! `user` cgroup of each hierarchy at [`USER_CGROUPS`]`/<controller>` (or
//! `unified` on cgroup v2). Each command gets its own cgroup there
//! (`exec-<n>`), joined between fork and exec, so that:
//!
//! - a command that times out or is cancelled is killed with everything it
//!   started, even what left its process group (`setsid cmd &`);
//! - a command that reaches the pids or memory limit is found out (its own
//!   counters), reported, and its runaway processes are killed, so that the
//!   next command starts;
//! - a command whose forks keep failing at the pids limit (a fork bomb) is
//!   killed while it runs ([`ForkWatch`]): churning at the limit, it would
//!   spend the host's kernel time on forks and exits until its timeout;
//! - the agent itself, outside `user`, always has the reserve to act with.
//!
//! In a microVM the agent is the guest kernel's PID 1 and makes the `user`
//! cgroup itself ([`setup_guest`]: cgroup v2, the guest's memory less the
//! reserve). Without either (a host without cgroups) commands run as
//! before: their process group is what a timeout kills.

use std::collections::HashSet;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::launcher::Launcher;
use crate::reaper::Reaper;

/// Where the jail monitor binds the sandbox's `user` cgroup directories.
pub const USER_CGROUPS: &str = "/.moat/cgroup";

/// The name a cgroup v2 hierarchy is bound under.
pub const UNIFIED: &str = "unified";

/// How long killing a command's cgroup may take before the agent stops
/// waiting for it to empty (the processes are SIGKILLed; the kernel only
/// needs a moment to reap them).
const KILL_GUARD: Duration = Duration::from_secs(5);

/// How often a running command's failed forks are counted.
pub const FORK_WATCH_PERIOD: Duration = Duration::from_millis(100);

/// How many periods in a row forks must fail for a command to be stopped:
/// a burst that meets the limit once and recovers (a parallel build)
/// keeps running; a fork bomb fails thousands of forks a second.
const FORK_FAILING_PERIODS: u32 = 3;

/// The periods a [`ForkWatch`] also judges together (3 s): a bomb of
/// shells fails in bursts, since bash sleeps 1, 2, 4 and 8 s before it
/// tries a failed fork again; at a limit of 60 its failures rise in one
/// period of every ten to twenty (measured: 36, 36 and 51 failed forks at
/// 0, 1.0 and 2.9 s), never in periods in a row.
const FORK_WINDOW: usize = 30;

/// Within [`FORK_WINDOW`], forks that failed in at least
/// [`FORK_FAILING_PERIODS`] of its periods and at least this many times
/// in all stop the command: dozens of failed forks a second, again and
/// again, is churning at the limit, not a build that met it.
const FORK_WINDOW_FAILURES: u64 = 64;

/// How long a sandbox cools down after moat killed a command's processes
/// at the pids limit: its next commands may start [`COOLING_SHARE`] of
/// the limit, so that a fork bomb lit again and again stops early each
/// time. Each kill starts the time again.
const COOLING: Duration = Duration::from_secs(60);

/// What share of the pids limit a cooling sandbox's commands have: a
/// sixteenth (60 of a jail's 960), and no fewer than [`COOLING_FLOOR`].
const COOLING_SHARE: u64 = 16;
const COOLING_FLOOR: u64 = 32;

/// How long a sandbox's next command waits when moat kills a runaway at
/// the pids limit again while the sandbox cools down: 1 s, then twice as
/// long for each kill after that, up to [`HOLD_MAX`]. A fork bomb lit in a
/// loop then costs the host a 60-process bomb every few seconds, not
/// several a second; a sandbox that ran away once does not wait at all.
const HOLD_FIRST: Duration = Duration::from_secs(1);
const HOLD_MAX: Duration = Duration::from_secs(8);

/// A sandbox's cooling down ([`COOLING`]).
#[derive(Debug, Default)]
struct Cooling {
    /// Until when commands start under the lower pids limit.
    until: Option<Instant>,
    /// Runaways killed since the cooling down began, the first one aside.
    strikes: u32,
    /// Before when the next command may not start.
    hold_until: Option<Instant>,
}

/// What a kill at the pids limit left a sandbox with: the lower limit of
/// its next commands, and how long the next one waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cooled {
    limit: Option<u64>,
    hold: Option<Duration>,
}

impl Cooled {
    /// In words, for the command's report; `None` when nothing is lowered.
    pub fn words(&self) -> Option<String> {
        let mut note = format!("moat: {}.\n", cooling_words(self.limit?));
        if let Some(hold) = self.hold {
            note.push_str(&format!(
                "moat: this sandbox ran away at its process limit again while cooling down: its next command \
                 starts after {} s (twice as long for each runaway after it, up to {} s).\n",
                hold.as_secs(),
                HOLD_MAX.as_secs()
            ));
        }
        Some(note)
    }
}

/// What [`ExecCgroup::top_processes`] says of an empty cgroup.
const NOTHING_LEFT: &str = "no process left";

/// How many processes a limit report names.
const REPORTED: usize = 3;

/// Where a microVM's agent mounts cgroup v2.
const GUEST_ROOT: &str = "/sys/fs/cgroup";

/// What a microVM's agent keeps beyond its commands' reach, as the host
/// keeps for a jail's agent (`RESERVE_PIDS` and `RESERVE_MEMORY` in
/// moat-core's `cgroup.rs`).
const GUEST_RESERVE_PIDS: u64 = 64;
const GUEST_RESERVE_MIB: u64 = 64;

/// The processes one sandbox may run at once (a jail's `PIDS_MAX`).
const GUEST_PIDS_MAX: u64 = 1024;

/// The `user` cgroup's CPU weight: a hundredth of the default (100) that
/// the agent, in the root cgroup, competes with.
const GUEST_USER_CPU_WEIGHT: u64 = 1;

/// How many processes a microVM's commands may run: [`GUEST_PIDS_MAX`]
/// less the reserve, and no more than one per MiB of their memory, so
/// that in a small guest a fork bomb stops at the pids limit (reported,
/// its processes killed) before it drives the guest into reclaiming
/// memory for minutes.
fn guest_pids(memory_bytes: u64) -> u64 {
    (GUEST_PIDS_MAX - GUEST_RESERVE_PIDS).min((memory_bytes >> 20).max(GUEST_RESERVE_PIDS))
}

/// The `user` cgroup [`setup_guest`] made, when it did.
static GUEST_USER: OnceLock<PathBuf> = OnceLock::new();

/// In a microVM: mounts cgroup v2 and makes the `user` cgroup every
/// command runs beneath, limited to the guest's available memory less
/// [`GUEST_RESERVE_MIB`] and to [`GUEST_PIDS_MAX`] less
/// [`GUEST_RESERVE_PIDS`] processes. The agent stays in the root cgroup,
/// outside those limits. Call before the first command.
pub fn setup_guest() -> std::io::Result<()> {
    let root = Path::new(GUEST_ROOT);
    std::fs::create_dir_all(root)?;
    let flags = nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV | nix::mount::MsFlags::MS_NOEXEC;
    match nix::mount::mount(Some("cgroup2"), root, Some("cgroup2"), flags, None::<&str>) {
        Ok(()) | Err(nix::errno::Errno::EBUSY) => {}
        Err(e) => return Err(e.into()),
    }
    std::fs::write(root.join("cgroup.subtree_control"), "+memory +pids")?;
    // CPU weight too, when the kernel has it: commands busy on every vCPU
    // (a fork bomb churning at its limit) leave the agent its share.
    let cpu = std::fs::write(root.join("cgroup.subtree_control"), "+cpu").is_ok();
    let user = root.join("user");
    match std::fs::create_dir(&user) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    let available_kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .ok_or_else(|| std::io::Error::other("no MemAvailable in /proc/meminfo"))?;
    let memory = (available_kib << 10).saturating_sub(GUEST_RESERVE_MIB << 20).max(GUEST_RESERVE_MIB << 20);
    std::fs::write(user.join("memory.max"), memory.to_string())?;
    if cpu {
        std::fs::write(user.join("cpu.weight"), GUEST_USER_CPU_WEIGHT.to_string())?;
    }
    // No swap in a microVM; said so that a kernel with swap accounting
    // does not let a command's memory spill past the limit.
    let _ = std::fs::write(user.join("memory.swap.max"), "0");
    std::fs::write(user.join("pids.max"), guest_pids(memory).to_string())?;
    std::fs::write(user.join("cgroup.subtree_control"), "+memory +pids")?;
    // The pids limit must be what stops a fork bomb, where moat sees and
    // reports it: a small guest's kernel defaults are below it (threads-max
    // from its memory, RLIMIT_NPROC half of that, inherited from PID 1).
    let threads_max = Path::new("/proc/sys/kernel/threads-max");
    let threads = std::fs::read_to_string(threads_max).ok().and_then(|t| t.trim().parse::<u64>().ok()).unwrap_or(0);
    if threads < 4 * GUEST_PIDS_MAX {
        std::fs::write(threads_max, (4 * GUEST_PIDS_MAX).to_string())?;
    }
    let unlimited = nix::sys::resource::RLIM_INFINITY;
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NPROC, unlimited, unlimited)?;
    let _ = GUEST_USER.set(user);
    Ok(())
}

/// The sandbox's `user` cgroups, as the agent sees them.
#[derive(Debug)]
pub struct UserCgroups {
    hierarchies: Vec<Hierarchy>,
    next: AtomicU64,
    /// Which command cgroups are in use and which wait, empty, for reuse.
    names: Mutex<Names>,
    /// Held while a command cgroup is made: a command that finds none free
    /// waits for one being made (by [`UserCgroups::prepare`]) rather than
    /// making a second.
    making: Mutex<()>,
    /// What [`UserCgroups::reclaim_for_later`] did, for the next command to say.
    reclaimed: Mutex<Vec<String>>,
    /// Held through a pass of [`UserCgroups::kill_runaways`]: a command's
    /// reclaim and a background watch may both find the same runaway, and
    /// the first to end its kill frees the cgroup, which the next command
    /// may take at once; the second's kill, still listing the cgroup's
    /// processes, then killed that command.
    reclaiming: Mutex<()>,
    /// The sandbox's cooling down after a runaway at the pids limit.
    cooling: Mutex<Cooling>,
    /// The agent's reaper, which launchers are spawned through.
    reaper: OnceLock<std::sync::Arc<Reaper>>,
}

/// The command cgroups the agent tracks. Neither kind is swept: an active
/// one may be empty because its child has not joined yet.
#[derive(Debug, Default)]
struct Names {
    active: HashSet<String>,
    /// Empty cgroups of finished commands, for the next ones, each with
    /// its launcher on cgroup v1: making and removing a cgroup in each
    /// hierarchy costs more than the rest of an exec, and moving a process
    /// into one stalls every fork on the host ([`crate::launcher`]).
    free: Vec<(String, Option<Launcher>)>,
    /// The counters, at its command's start, of each cgroup whose command
    /// left processes running in it: what that command alone counted is
    /// what [`UserCgroups::reclaim`] judges (a reused cgroup's counters
    /// also hold its earlier commands' events).
    left: std::collections::HashMap<String, Counters>,
}

impl Names {
    /// Whether cgroup `name` has an owner (a command, a pass) or waits free.
    fn taken(&self, name: &str) -> bool {
        self.active.contains(name) || self.free.iter().any(|(free, _)| free == name)
    }
}

/// How many empty command cgroups are kept for reuse.
const KEPT_FREE: usize = 8;

#[derive(Debug, Clone)]
struct Hierarchy {
    /// `memory`, `pids`, `freezer`, `cpu` (v1) or [`UNIFIED`].
    name: String,
    dir: PathBuf,
}

impl Hierarchy {
    fn is(&self, controller: &str) -> bool {
        self.name == controller || self.name == UNIFIED
    }
}

/// The `user` cgroups bound into this sandbox, found once.
pub fn user_cgroups() -> Option<&'static UserCgroups> {
    static FOUND: OnceLock<Option<UserCgroups>> = OnceLock::new();
    FOUND
        .get_or_init(|| match GUEST_USER.get() {
            Some(user) => Some(UserCgroups::unified(user.clone())),
            None => UserCgroups::discover(Path::new(USER_CGROUPS)),
        })
        .as_ref()
}

impl UserCgroups {
    /// Finds the hierarchies bound under `root`; `None` when there are none.
    pub fn discover(root: &Path) -> Option<Self> {
        let mut hierarchies: Vec<Hierarchy> = std::fs::read_dir(root)
            .ok()?
            .filter_map(Result::ok)
            .filter(|e| e.path().join("cgroup.procs").exists())
            .map(|e| Hierarchy { name: e.file_name().to_string_lossy().into_owned(), dir: e.path() })
            .collect();
        if hierarchies.is_empty() {
            return None;
        }
        // The freezer goes first: a frozen command cannot fork while the
        // other hierarchies are joined or emptied.
        hierarchies.sort_by_key(|h| (h.name != "freezer", h.name.clone()));
        Some(Self::of(hierarchies))
    }

    /// The `user` cgroup `dir` of a cgroup v2 hierarchy.
    fn unified(dir: PathBuf) -> Self {
        Self::of(vec![Hierarchy { name: UNIFIED.into(), dir }])
    }

    fn of(hierarchies: Vec<Hierarchy>) -> Self {
        Self {
            hierarchies,
            next: AtomicU64::new(1),
            names: Mutex::default(),
            making: Mutex::default(),
            reclaimed: Mutex::default(),
            reclaiming: Mutex::default(),
            cooling: Mutex::default(),
            reaper: OnceLock::new(),
        }
    }

    fn names(&self) -> MutexGuard<'_, Names> {
        // Each critical section is a few set operations: a panic leaves it whole.
        self.names.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes command cgroup `name` for one owner (a command being given
    /// it, a pass killing or removing it) unless another has it or it
    /// waits free: each cgroup has one owner at a time, and a pass that
    /// judged it from a listing acts on it only once it is its own. False
    /// when it is another's; [`UserCgroups::unclaim`] gives it up.
    fn claim(&self, name: &str) -> bool {
        let mut names = self.names();
        if names.taken(name) {
            return false;
        }
        names.active.insert(name.to_owned());
        true
    }

    fn unclaim(&self, name: &str) {
        self.names().active.remove(name);
    }

    /// Whether `exec` still holds what its command left running, as
    /// [`ExecCgroup::release`] recorded: not emptied and handed out since.
    pub fn holds_left(&self, exec: &ExecCgroup) -> bool {
        self.names().left.contains_key(&exec.name)
    }

    /// An empty cgroup of an earlier command (and its launcher), now
    /// active, if one waits.
    fn take_free(&self) -> Option<(String, Option<Launcher>)> {
        let mut names = self.names();
        let free = names.free.pop()?;
        names.active.insert(free.0.clone());
        Some(free)
    }

    /// Whether commands start through launchers kept in their cgroups:
    /// on cgroup v1, where joining a cgroup takes host-wide locks.
    fn launchers(&self) -> bool {
        !self.hierarchies.iter().any(|h| h.name == UNIFIED)
    }

    /// Gives `name`, a clean command cgroup handed back by its command
    /// (and kept active meanwhile, out of the sweeps), its launcher, then
    /// frees it for the next command. Runs after the command's answer was
    /// sent: a one-command sandbox's command waits for no launcher, and
    /// its next commands start without a migration.
    fn equip(&self, name: &str) {
        let launcher = self.reaper.get().and_then(|reaper| {
            let procs: std::io::Result<Vec<std::fs::File>> = self
                .hierarchies
                .iter()
                .map(|h| std::fs::OpenOptions::new().write(true).open(h.dir.join(name).join("cgroup.procs")))
                .collect();
            let procs = procs.ok()?;
            let fds: Vec<i32> = procs.iter().map(AsRawFd::as_raw_fd).collect();
            match Launcher::spawn(reaper, &fds) {
                Ok(launcher) => Some(launcher),
                Err(e) => {
                    tracing::warn!("commands of {name} join their cgroup themselves: no launcher: {e}");
                    None
                }
            }
        });
        let mut names = self.names();
        names.active.remove(name);
        names.free.push((name.to_owned(), launcher));
    }

    /// Makes the cgroup of one command. Its pids and memory limits are the
    /// `user` cgroup's own, so that a command that alone exhausts them is
    /// counted in its own cgroup's events.
    pub fn create_exec(&'static self, reaper: &std::sync::Arc<Reaper>) -> std::io::Result<ExecCgroup> {
        let _ = self.reaper.set(reaper.clone());
        let exec = match self.reuse_free() {
            Some(exec) => exec,
            None => {
                // A poisoned lock guards nothing but the order of makers.
                let _making = self.making.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                // One made meanwhile (the agent makes one ahead at start) is taken.
                match self.reuse_free() {
                    Some(exec) => exec,
                    None => self.make_exec()?,
                }
            }
        };
        self.set_pids_limit(&exec);
        Ok(exec)
    }

    fn cooling_state(&self) -> std::sync::MutexGuard<'_, Cooling> {
        // A poisoned lock guards plain figures, whole at every step.
        let mut cooling = self.cooling.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if cooling.until.is_some_and(|until| Instant::now() >= until) {
            *cooling = Cooling::default();
        }
        cooling
    }

    /// Starts (or starts again) the sandbox's cooling down after moat
    /// killed a command's processes at the pids limit: the lower limit its
    /// next commands have, when the sandbox has a pids limit, and, when it
    /// was cooling down already, how long its next command waits.
    fn cool_down(&self) -> Cooled {
        let now = Instant::now();
        let mut cooling = self.cooling_state();
        let hold = if cooling.until.is_some() {
            let hold = HOLD_FIRST.saturating_mul(1 << cooling.strikes.min(8)).min(HOLD_MAX);
            cooling.strikes += 1;
            cooling.hold_until = Some(now + hold);
            Some(hold)
        } else {
            None
        };
        cooling.until = Some(now + COOLING);
        drop(cooling);
        Cooled { limit: self.pids_limits().map(|(_, cooling)| cooling), hold }
    }

    /// The lower pids limit commands start with now, while the sandbox
    /// cools down.
    fn cooling(&self) -> Option<u64> {
        let cooling = self.cooling_state().until;
        cooling.and_then(|_| self.pids_limits()).map(|(_, cooling)| cooling)
    }

    /// How long a command starting now waits, after repeated runaways.
    pub fn hold(&self) -> Option<Duration> {
        let hold_until = self.cooling_state().hold_until?;
        hold_until.checked_duration_since(Instant::now()).filter(|hold| !hold.is_zero())
    }

    /// The `user` cgroup's processes and threads now and its limit, as
    /// `pids.current` and `pids.max` say.
    pub fn pids_in_use(&self) -> Option<(u64, u64)> {
        let user = self.hierarchies.iter().find(|h| h.is("pids"))?;
        let read = |file: &str| std::fs::read_to_string(user.dir.join(file)).ok()?.trim().parse().ok();
        Some((read("pids.current")?, read("pids.max")?))
    }

    /// The `user` cgroup's pids limit and a cooling sandbox's share of it;
    /// `None` without a pids controller or a limit.
    fn pids_limits(&self) -> Option<(u64, u64)> {
        let user = self.hierarchies.iter().find(|h| h.is("pids"))?;
        let limit: u64 = read_counter_file(&user.dir.join("pids.max")).ok()?.trim().parse().ok()?;
        Some((limit, (limit / COOLING_SHARE).max(COOLING_FLOOR).min(limit)))
    }

    /// Gives a command's cgroup the pids limit a command starting now
    /// has: the `user` cgroup's, or the lower one while the sandbox cools
    /// down.
    fn set_pids_limit(&self, exec: &ExecCgroup) {
        let Some((limit, cooling)) = self.pids_limits() else { return };
        let wanted = if self.cooling_state().until.is_some() { cooling } else { limit };
        if let Some(dir) = exec.dir("pids") {
            let file = dir.join("pids.max");
            if read_counter_file(&file).ok().and_then(|now| now.trim().parse::<u64>().ok()) != Some(wanted)
                && let Err(e) = std::fs::write(&file, wanted.to_string())
            {
                tracing::warn!("could not set {}: {e}", file.display());
            }
        }
    }

    /// A free command cgroup, checked empty and opened, if one waits.
    fn reuse_free(&'static self) -> Option<ExecCgroup> {
        while let Some((name, launcher)) = self.take_free() {
            let mut exec = ExecCgroup::existing(&self.hierarchies, &name);
            exec.owner = Some(self);
            exec.launcher_pid = launcher.as_ref().map(Launcher::pid);
            // A command started by the launcher is born in the cgroup:
            // only one without a launcher joins it through these files.
            let opened: std::io::Result<Vec<OwnedFd>> = match launcher {
                Some(_) => Ok(Vec::new()),
                None => exec
                    .dirs
                    .iter()
                    .map(|h| {
                        std::fs::OpenOptions::new().write(true).open(h.dir.join("cgroup.procs")).map(OwnedFd::from)
                    })
                    .collect(),
            };
            match opened {
                Ok(procs) if exec.process_count() == 0 => {
                    exec.set_launcher(launcher);
                    exec.procs = procs;
                    exec.baseline = exec.counters();
                    return Some(exec);
                }
                // Gone or taken over: made afresh.
                _ => {
                    drop(launcher);
                    exec.remove();
                }
            }
        }
        None
    }

    /// Makes a new command cgroup in every hierarchy.
    fn make_exec(&'static self) -> std::io::Result<ExecCgroup> {
        self.sweep();
        // Claimed before it exists: a pass listing the directories (a
        // reclaim, a sweep) finds it in use, never idle. Found idle in
        // that window, it was once kept free too, and two commands were
        // later handed the one cgroup: a kill meant for one took the other
        // and its launcher.
        let name = loop {
            let name = format!("exec-{}", self.next.fetch_add(1, Ordering::Relaxed));
            if !self.claim(&name) {
                continue;
            }
            match self.hierarchies.first().map(|h| std::fs::create_dir(h.dir.join(&name))) {
                Some(Err(e)) if e.kind() == std::io::ErrorKind::AlreadyExists => self.unclaim(&name),
                Some(Err(e)) => {
                    self.unclaim(&name);
                    return Err(e);
                }
                _ => break name,
            }
        };
        let mut exec = ExecCgroup::existing(&self.hierarchies, &name);
        exec.owner = Some(self);
        let mut procs = Vec::new();
        for h in &self.hierarchies {
            let dir = h.dir.join(&name);
            if let Err(e) = std::fs::create_dir(&dir)
                && e.kind() != std::io::ErrorKind::AlreadyExists
            {
                exec.remove();
                return Err(e);
            }
            for file in limit_files(h) {
                if let Ok(value) = std::fs::read_to_string(h.dir.join(file)) {
                    let _ = std::fs::write(dir.join(file), value.trim());
                }
            }
            match std::fs::OpenOptions::new().write(true).open(dir.join("cgroup.procs")) {
                Ok(file) => procs.push(OwnedFd::from(file)),
                Err(e) => {
                    exec.remove();
                    return Err(e);
                }
            }
        }
        exec.procs = procs;
        exec.baseline = exec.counters();
        Ok(exec)
    }

    /// Makes one command cgroup ahead of the first command and keeps it
    /// free: the agent does it while the host's first request is on its
    /// way, instead of on that command's path.
    pub fn prepare(&'static self, reaper: &std::sync::Arc<Reaper>) {
        match self.create_exec(reaper) {
            Ok(exec) => {
                exec.release(false);
            }
            Err(e) => tracing::debug!("no command cgroup made ahead: {e}"),
        }
    }

    /// Removes the cgroups of earlier commands that have no process left,
    /// and kills those that still run after reaching a limit (a fork bomb
    /// sent to the background): their processes hold the sandbox's limit.
    /// Returns what it did, for the next command's output.
    pub fn reclaim(&self) -> Option<String> {
        let mut killed = std::mem::take(&mut *self.reclaimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        killed.extend(self.kill_runaways());
        if killed.is_empty() {
            return None;
        }
        let mut note = format!("moat: killed {} to free the sandbox.\n", killed.join("; "));
        let cooled = Cooled { limit: self.cooling(), hold: self.hold() };
        note.push_str(&cooled.words().unwrap_or_default());
        Some(note)
    }

    /// [`UserCgroups::reclaim`] between commands (a fork bomb left in the
    /// background); the next command's output says what it did.
    pub fn reclaim_for_later(&self) {
        let killed = self.kill_runaways();
        self.reclaimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(killed);
    }

    /// Kills what is left of earlier commands that reached a limit; says
    /// what, one line each.
    fn kill_runaways(&self) -> Vec<String> {
        // A poisoned lock guards nothing but the order of passes.
        let _pass = self.reclaiming.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut runaways = Vec::new();
        for dir in self.idle_exec_dirs() {
            // Judged and killed as this pass's own: listed idle, it may
            // have been emptied, freed and handed to a command since.
            if !self.claim(&dir) {
                continue;
            }
            let mut exec = ExecCgroup::existing(&self.hierarchies, &dir);
            exec.baseline = self.names().left.get(&dir).copied().unwrap_or_default();
            match exec.reached_limit() {
                Some(hit) if exec.process_count() > 0 => runaways.push((exec, hit)),
                _ => {
                    self.unclaim(&dir);
                    self.remove_idle(&exec);
                }
            }
        }
        // Several bombs lit one after another share the sandbox's limit:
        // all are frozen before any is killed, or those still running
        // take the places of the one being killed (and, forking, hold up
        // its processes' exits on the host's locks) for as long as it takes.
        for (exec, _) in &runaways {
            exec.freeze();
        }
        let mut killed = Vec::new();
        for (exec, _) in &runaways {
            let top = exec.top_processes();
            let count = exec.kill();
            killed.push(format!("{count} processes of an earlier command that reached a limit ({top})"));
            self.unclaim(&exec.name);
            self.remove_idle(exec);
        }
        if runaways.iter().any(|(_, hit)| matches!(hit, LimitHit::Pids { .. })) {
            self.cool_down();
        }
        killed
    }

    fn sweep(&self) {
        for dir in self.idle_exec_dirs() {
            self.remove_idle(&ExecCgroup::existing(&self.hierarchies, &dir));
        }
    }

    /// Once an earlier command's processes are gone (they ended, or were
    /// killed at a limit and have died since), its cgroup is kept for the
    /// next commands like any emptied one (up to [`KEPT_FREE`]), or removed.
    fn remove_idle(&self, exec: &ExecCgroup) {
        if exec.process_count() != 0 {
            return;
        }
        let mut names = self.names();
        // Judged idle before this lock: another pass (a sweep beside a
        // reclaim) may have kept it meanwhile, and a command taken it
        // since. Removing it then took a command's cgroup from under it
        // (its start failed with ENODEV); keeping it twice would give two
        // commands one cgroup.
        if names.taken(&exec.name) {
            return;
        }
        names.left.remove(&exec.name);
        if names.free.len() < KEPT_FREE {
            // Its first command joins it directly (cgroup v1: then gets
            // a launcher), as in a new one.
            names.free.push((exec.name.clone(), None));
        } else {
            // Active while it is removed: out of every other pass's sight.
            names.active.insert(exec.name.clone());
            drop(names);
            exec.remove();
            self.names().active.remove(&exec.name);
        }
    }

    /// Names of the command cgroups in the first hierarchy.
    fn exec_dirs(&self) -> Vec<String> {
        let Some(first) = self.hierarchies.first() else { return Vec::new() };
        std::fs::read_dir(&first.dir)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("exec-"))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Names of the command cgroups no running exec uses: earlier
    /// commands' (their background processes may still run in them).
    fn idle_exec_dirs(&self) -> Vec<String> {
        let mut dirs = self.exec_dirs();
        let names = self.names();
        dirs.retain(|d| !names.taken(d));
        dirs
    }

    /// Forks refused at the limit all commands share (`user`'s
    /// `pids.max`): commands that together fill it, none filling its own
    /// cgroup's, show there and not in their own counters.
    pub fn failed_forks(&self) -> u64 {
        self.hierarchies.iter().find(|h| h.is("pids")).map_or(0, |h| counter(&h.dir.join("pids.events"), "max"))
    }

    /// Whether `exec` holds the most processes of all command cgroups: the
    /// one moat stops when commands together keep failing their forks at
    /// the shared limit (two fork bombs, the second lit while the first
    /// still grew). The others are judged again when forks keep failing.
    /// Counted in tasks, as the limit counts them: a process of a thousand
    /// threads holds more than a shell that forks a few.
    pub fn holds_the_most(&self, exec: &ExecCgroup) -> bool {
        let mine = exec.task_count();
        mine > 0 && self.exec_dirs().iter().all(|dir| ExecCgroup::existing(&self.hierarchies, dir).task_count() <= mine)
    }

    /// The shared pids limit, as a report names it.
    pub fn shared_pids_hit(&self) -> LimitHit {
        let limit = self.pids_limits().map(|(limit, _)| limit.to_string()).unwrap_or_else(|| "max".into());
        LimitHit::Pids { limit }
    }

    /// Kills what a finished command left running (`exec`'s) when it
    /// holds the most processes while forks keep failing at the shared
    /// limit; the next command says so. Judged and killed as this pass's
    /// own, claimed while it still holds what that command left: never
    /// once it was emptied and handed to another command.
    pub fn stop_filling(&self, exec: &ExecCgroup) -> Filling {
        {
            let mut names = self.names();
            if !names.left.contains_key(&exec.name) {
                return Filling::Gone;
            }
            if names.taken(&exec.name) {
                return Filling::Busy;
            }
            names.active.insert(exec.name.clone());
        }
        let exec = ExecCgroup::existing(&self.hierarchies, &exec.name);
        if !self.holds_the_most(&exec) {
            self.unclaim(&exec.name);
            return Filling::NotTheMost;
        }
        let top = exec.top_processes();
        let count = exec.kill();
        self.unclaim(&exec.name);
        self.remove_idle(&exec);
        if count > 0 {
            let line =
                format!("{count} processes of an earlier command that filled the sandbox's process limit ({top})");
            self.reclaimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(line);
            self.cool_down();
        }
        Filling::Stopped
    }

    /// How many processes run in the sandbox's `user` cgroup, all commands together.
    pub fn process_count(&self) -> usize {
        self.exec_dirs().iter().map(|dir| ExecCgroup::existing(&self.hierarchies, dir).process_count()).sum()
    }
}

/// The files that carry a limit a command's cgroup copies from `user`.
fn limit_files(h: &Hierarchy) -> &'static [&'static str] {
    match h.name.as_str() {
        UNIFIED => &["pids.max", "memory.max"],
        "pids" => &["pids.max"],
        "memory" => &["memory.limit_in_bytes"],
        _ => &[],
    }
}

/// Which limit a command reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitHit {
    /// Forks failed at the pids limit (`limit` processes).
    Pids { limit: String },
    /// The kernel's OOM killer ended `kills` processes at the memory limit.
    Memory { limit_bytes: Option<u64>, kills: u64 },
    /// The command stalled at the memory limit for `seconds` (the kernel
    /// reclaiming its file pages again and again instead of ending it);
    /// moat ends it.
    MemoryStall { limit_bytes: Option<u64>, seconds: u64 },
}

/// What [`UserCgroups::stop_filling`] made of what a command left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filling {
    /// It held the most, and was killed.
    Stopped,
    /// Another command's cgroup holds more: left running.
    NotTheMost,
    /// Another pass has the cgroup now (a reclaim judging it).
    Busy,
    /// It no longer holds what that command left: emptied since.
    Gone,
}

/// The cgroup of one command: one directory per hierarchy.
#[derive(Debug)]
pub struct ExecCgroup {
    name: String,
    /// Set for a command's own cgroup, to release its name when done.
    owner: Option<&'static UserCgroups>,
    dirs: Vec<Hierarchy>,
    /// Its `cgroup.procs` files, open for the child to join between fork
    /// and exec (writing `0` moves the writer).
    procs: Vec<OwnedFd>,
    /// Its counters when the command started (a reused cgroup keeps those
    /// of the commands before).
    baseline: Counters,
    /// Handed back by [`ExecCgroup::release`].
    released: std::sync::atomic::AtomicBool,
    /// The cgroup's launcher while no command uses it (cgroup v1).
    launcher: LauncherSlot,
    /// The launcher's pid, which is no command's process.
    launcher_pid: Option<i32>,
}

/// Where a launcher waits between commands; a command's exit hands it back.
pub type LauncherSlot = std::sync::Arc<Mutex<Option<Launcher>>>;

/// The events a limit report is made from.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    /// Forks refused at the pids limit.
    pids_max: u64,
    /// Processes the OOM killer ended.
    oom_kills: u64,
    /// Processes the OOM killer ended at the `user` cgroup's limit, which
    /// all commands share (what earlier ones left in tmpfs counts there).
    user_oom_kills: u64,
}

impl ExecCgroup {
    fn existing(hierarchies: &[Hierarchy], name: &str) -> Self {
        let dirs = hierarchies.iter().map(|h| Hierarchy { name: h.name.clone(), dir: h.dir.join(name) }).collect();
        Self {
            name: name.to_owned(),
            owner: None,
            dirs,
            procs: Vec::new(),
            baseline: Counters::default(),
            released: std::sync::atomic::AtomicBool::new(false),
            launcher: LauncherSlot::default(),
            launcher_pid: None,
        }
    }

    fn set_launcher(&self, launcher: Option<Launcher>) {
        *self.launcher.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = launcher;
    }

    /// The cgroup's launcher, for one command to start through; the
    /// command's exit puts it back in [`ExecCgroup::launcher_slot`].
    pub fn take_launcher(&self) -> Option<Launcher> {
        self.launcher.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }

    pub fn launcher_slot(&self) -> LauncherSlot {
        self.launcher.clone()
    }

    /// The memory controller's events file and its limit file: cgroup v2's
    /// where the controller is the unified hierarchy's, else v1's.
    fn memory_files(&self) -> (&'static str, &'static str) {
        if self.dirs.iter().find(|h| h.is("memory")).is_some_and(|h| h.name == UNIFIED) {
            ("memory.events", "memory.max")
        } else {
            ("memory.oom_control", "memory.limit_in_bytes")
        }
    }

    fn counters(&self) -> Counters {
        Counters {
            pids_max: self.failed_forks(),
            oom_kills: self.dir("memory").map_or(0, |dir| counter(&dir.join(self.memory_files().0), "oom_kill")),
            user_oom_kills: self
                .dir("memory")
                .and_then(Path::parent)
                .map_or(0, |user| counter(&user.join(self.memory_files().0), "oom_kill")),
        }
    }

    /// The raw descriptors of its `cgroup.procs` files, for a child to
    /// join it by: those kept open, or, for a cgroup whose commands start
    /// through its launcher (none at hand now), opened into `opened`.
    pub fn join_fds(&self, opened: &mut Vec<OwnedFd>) -> std::io::Result<Vec<i32>> {
        if self.procs.is_empty() {
            for h in &self.dirs {
                let file = std::fs::OpenOptions::new().write(true).open(h.dir.join("cgroup.procs"))?;
                opened.push(OwnedFd::from(file));
            }
            return Ok(opened.iter().map(AsRawFd::as_raw_fd).collect());
        }
        Ok(self.procs.iter().map(AsRawFd::as_raw_fd).collect())
    }

    /// Closes the `cgroup.procs` files once the child has joined.
    pub fn joined(&mut self) {
        self.procs.clear();
    }

    fn dir(&self, controller: &str) -> Option<&Path> {
        self.dirs.iter().find(|h| h.is(controller)).map(|h| h.dir.as_path())
    }

    /// Pids of every process in the command's cgroup, as this pid namespace numbers them.
    pub fn pids(&self) -> Vec<i32> {
        self.dirs
            .first()
            .and_then(|h| std::fs::read_to_string(h.dir.join("cgroup.procs")).ok())
            .map(|procs| {
                procs
                    .lines()
                    .filter_map(|p| p.trim().parse().ok())
                    .filter(|pid| Some(*pid) != self.launcher_pid)
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn process_count(&self) -> usize {
        self.pids().len()
    }

    /// The limit the command reached, if any, from its cgroup's counters.
    pub fn reached_limit(&self) -> Option<LimitHit> {
        let now = self.counters();
        if let Some(dir) = self.dir("pids")
            && now.pids_max > self.baseline.pids_max
        {
            let limit = read_counter_file(&dir.join("pids.max")).unwrap_or_default().trim().to_owned();
            return Some(LimitHit::Pids { limit });
        }
        if let Some(dir) = self.dir("memory") {
            let limit = self.memory_files().1;
            let mut kills = now.oom_kills.saturating_sub(self.baseline.oom_kills);
            // The limit shared by all commands, reached while this one ran
            // (only for a running command's own cgroup, whose baseline was
            // read when it started).
            if kills == 0 && self.owner.is_some() {
                kills = now.user_oom_kills.saturating_sub(self.baseline.user_oom_kills);
            }
            if kills > 0 {
                let limit_bytes = read_counter_file(&dir.join(limit)).ok().and_then(|l| l.trim().parse().ok());
                return Some(LimitHit::Memory { limit_bytes, kills });
            }
        }
        None
    }

    /// How long, in microseconds, all of this command's processes have
    /// stalled on memory so far (`memory.pressure` `full total=`), and how
    /// often its memory limit was met (`memory.events` `max`): cgroup v2
    /// only, `None` elsewhere (v1 keeps no pressure per cgroup).
    pub fn memory_stall(&self) -> Option<(u64, u64)> {
        let dir = self.dirs.iter().find(|h| h.is("memory") && h.name == UNIFIED)?.dir.as_path();
        let pressure = std::fs::read_to_string(dir.join("memory.pressure")).ok()?;
        let stalled = pressure
            .lines()
            .find_map(|l| l.strip_prefix("full "))?
            .split_whitespace()
            .find_map(|field| field.strip_prefix("total="))?
            .parse()
            .ok()?;
        Some((stalled, counter(&dir.join("memory.events"), "max")))
    }

    /// The memory limit of this cgroup, in bytes, when it has one.
    pub fn memory_limit(&self) -> Option<u64> {
        let dir = self.dir("memory")?;
        read_counter_file(&dir.join(self.memory_files().1)).ok()?.trim().parse().ok()
    }

    /// Forks refused at the pids limit in this cgroup so far (its
    /// `pids.events` `max`); 0 without a pids controller.
    pub fn failed_forks(&self) -> u64 {
        self.dir("pids").map_or(0, |dir| counter(&dir.join("pids.events"), "max"))
    }

    /// The processes that hold the most, in words: by the tasks the pids
    /// limit counts (`bash ×957`; `python3 ×1 (959 threads)`), then by
    /// resident memory.
    pub fn top_processes(&self) -> String {
        // Per name: processes, tasks (their threads), resident KiB.
        let mut by_name: std::collections::BTreeMap<String, (usize, u64, u64)> = std::collections::BTreeMap::new();
        for pid in self.pids() {
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_owned();
            let (rss, threads) = status_figures(pid);
            let entry = by_name.entry(if name.is_empty() { "?".into() } else { name }).or_default();
            entry.0 += 1;
            entry.1 += threads.max(1);
            entry.2 += rss;
        }
        let mut top: Vec<_> = by_name.into_iter().collect();
        top.sort_by_key(|(_, (_, tasks, kib))| std::cmp::Reverse((*tasks, *kib)));
        let words: Vec<String> = top
            .iter()
            .take(REPORTED)
            .map(|(name, (count, tasks, kib))| {
                let threads = if *tasks > *count as u64 { format!(" ({tasks} threads)") } else { String::new() };
                format!("{name} ×{count}{threads}, {} MiB resident", kib / 1024)
            })
            .collect();
        if words.is_empty() { NOTHING_LEFT.into() } else { words.join(", ") }
    }

    /// How many tasks (processes and their threads) the command's cgroup
    /// holds, as its pids limit counts them (`pids.current`, the
    /// launcher's one left out); its processes without a pids controller.
    pub fn task_count(&self) -> usize {
        let current = self
            .dir("pids")
            .and_then(|dir| std::fs::read_to_string(dir.join("pids.current")).ok())
            .and_then(|n| n.trim().parse::<usize>().ok());
        match current {
            Some(tasks) => tasks.saturating_sub(usize::from(self.launcher_pid.is_some())),
            None => self.process_count(),
        }
    }

    /// When the command reached a pids or memory limit: kills everything
    /// in its cgroup and returns the report, without the cooling down a
    /// runaway starts (its timeout ended it, not moat's watch: a thread
    /// bomb that met the pids limit once and held it from then on).
    pub fn kill_reporting_limit(&self) -> Option<String> {
        let hit = self.reached_limit()?;
        Some(self.kill_and_report(&hit).0)
    }

    /// Kills everything in the command's cgroup for `hit`: the report
    /// (what held the limit, read before the kill; after a memory limit,
    /// the files that hold it) and how many processes were killed.
    fn kill_and_report(&self, hit: &LimitHit) -> (String, usize) {
        let top = self.top_processes();
        let killed = self.kill();
        let report = describe(hit, &top, killed) + &files_note(hit, files_in_memory).unwrap_or_default();
        (report, killed)
    }

    /// Kills every process in the command's cgroup; returns how many there
    /// were. Once released, the cgroup may be another command's: nothing.
    pub fn kill(&self) -> usize {
        if self.released.load(Ordering::SeqCst) {
            return 0;
        }
        let count = self.process_count();
        if let Some(dir) = self.dir(UNIFIED)
            && std::fs::write(dir.join("cgroup.kill"), "1").is_ok()
        {
            self.wait_empty();
            return count;
        }
        // cgroup v1: freeze, so that nothing forks while being killed, kill
        // every member, thaw so that the kills land.
        let freezer = self.dir("freezer").filter(|d| std::fs::write(d.join("freezer.state"), "FROZEN").is_ok());
        let give_up = Instant::now() + KILL_GUARD;
        loop {
            let members = self.members();
            if members.is_empty() || Instant::now() > give_up {
                break;
            }
            for member in &members {
                let _ = member.kill();
            }
            if let Some(dir) = freezer {
                let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
            }
            crate::pidfd::wait_all(&members, give_up);
        }
        if let Some(dir) = freezer {
            let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
        }
        self.wait_empty();
        count
    }

    /// Stops every process of the cgroup where it is (cgroup v1's freezer),
    /// ahead of [`ExecCgroup::kill`]; nothing on v2, whose `cgroup.kill`
    /// needs no freezing.
    fn freeze(&self) {
        if self.dir(UNIFIED).is_none()
            && let Some(dir) = self.dir("freezer")
        {
            let _ = std::fs::write(dir.join("freezer.state"), "FROZEN");
        }
    }

    /// Pidfds of every process in the command's cgroup, each opened while
    /// the process was listed there (a pid reused meanwhile is never named).
    fn members(&self) -> Vec<crate::pidfd::Pidfd> {
        let opened: Vec<(i32, crate::pidfd::Pidfd)> = self
            .pids()
            .into_iter()
            .filter_map(|pid| crate::pidfd::Pidfd::of_pid(pid).ok().map(|fd| (pid, fd)))
            .collect();
        let still = self.pids();
        opened.into_iter().filter(|(pid, _)| still.contains(pid)).map(|(_, fd)| fd).collect()
    }

    /// Waits, on their pidfds, until the processes in the command's cgroup
    /// have ended (a process leaves `cgroup.procs` as it ends, before its
    /// pidfd reads ready), or [`KILL_GUARD`].
    fn wait_empty(&self) {
        let give_up = Instant::now() + KILL_GUARD;
        loop {
            let members = self.members();
            if members.is_empty() || !crate::pidfd::wait_all(&members, give_up) {
                return;
            }
        }
    }

    /// Kills everything in the command's cgroup for `hit` and returns the
    /// report for its stderr; processes that ran away at the pids limit
    /// also start the sandbox's cooling down ([`COOLING`]), which the
    /// report ends with.
    pub fn kill_for(&self, hit: &LimitHit) -> String {
        let (mut report, killed) = self.kill_and_report(hit);
        if killed > 0
            && matches!(hit, LimitHit::Pids { .. })
            && let Some(note) = self.owner.and_then(|owner| owner.cool_down().words())
        {
            report.push_str(&note);
        }
        report
    }

    /// Hands a command's cgroup back once the command is done: kept for
    /// the next command when empty (up to [`KEPT_FREE`]), removed when
    /// empty beyond that, left to the sweep while background processes run
    /// in it. With `defer_launcher`, an empty cgroup that has no launcher
    /// yet (on cgroup v1) stays active and is returned for
    /// [`ExecCgroup::equip`] once the command's answer is sent.
    ///
    /// One whose command reached a limit is reused too, once its processes
    /// are killed: each command reads its own baseline of the counters.
    /// Making a fresh one for each command of a sandbox that keeps
    /// reaching its limit (a fork bomb lit again and again) would move a
    /// process into a new cgroup each time, and on cgroup v1 every such
    /// move stalls every fork on the host ([`crate::launcher`]).
    pub fn release(&self, defer_launcher: bool) -> bool {
        let Some(owner) = self.owner else { return false };
        if self.released.swap(true, Ordering::SeqCst) {
            return false;
        }
        let empty = self.process_count() == 0;
        let launcher = self.take_launcher();
        let mut names = owner.names();
        if !empty {
            names.left.insert(self.name.clone(), self.baseline);
        }
        if empty && names.free.len() < KEPT_FREE {
            if launcher.is_none() && owner.launchers() && defer_launcher {
                return true;
            }
            names.active.remove(&self.name);
            names.free.push((self.name.clone(), launcher));
        } else {
            drop(names);
            // Its socket closed, the launcher ends; the cgroup goes once
            // empty (here, or in a later sweep).
            drop(launcher);
            if empty {
                self.remove();
            }
            // Active until removed: a sweep in between would keep it as
            // free and hand the next command a cgroup about to go.
            owner.names().active.remove(&self.name);
        }
        false
    }

    /// Gives the cgroup its launcher and frees it: for a cgroup
    /// [`ExecCgroup::release`] kept back.
    pub fn equip(&self) {
        if let Some(owner) = self.owner {
            owner.equip(&self.name);
        }
    }

    fn remove(&self) {
        for h in &self.dirs {
            close_counter_files(&h.dir);
            let _ = std::fs::remove_dir(&h.dir);
        }
    }
}

impl Drop for ExecCgroup {
    fn drop(&mut self) {
        // Not released (the command never started): its name is free to be
        // swept once empty.
        if let Some(owner) = self.owner
            && !self.released.load(Ordering::SeqCst)
        {
            owner.names().active.remove(&self.name);
        }
    }
}

/// Tells a command whose forks keep failing at the pids limit from one that
/// met it once: fed the failed-fork counter every [`FORK_WATCH_PERIOD`],
/// it says to stop the command once the count rose [`FORK_FAILING_PERIODS`]
/// times in a row, or in bursts of at least [`FORK_WINDOW_FAILURES`]
/// within [`FORK_WINDOW`] periods.
#[derive(Debug)]
pub struct ForkWatch {
    last: u64,
    rising: u32,
    /// How much the counter rose in each of the last [`FORK_WINDOW`] periods.
    window: std::collections::VecDeque<u64>,
}

impl ForkWatch {
    /// Starts from the counter's value when the command started.
    pub fn new(baseline: u64) -> Self {
        Self { last: baseline, rising: 0, window: std::collections::VecDeque::with_capacity(FORK_WINDOW) }
    }

    /// Takes the counter's value now; `true` when the command is to be stopped.
    pub fn observe(&mut self, failed_forks: u64) -> bool {
        let rose = failed_forks.saturating_sub(self.last);
        self.rising = if rose > 0 { self.rising + 1 } else { 0 };
        self.last = failed_forks;
        if self.window.len() == FORK_WINDOW {
            self.window.pop_front();
        }
        self.window.push_back(rose);
        let periods = self.window.iter().filter(|rose| **rose > 0).count();
        let failures: u64 = self.window.iter().sum();
        self.rising >= FORK_FAILING_PERIODS
            || (periods >= FORK_FAILING_PERIODS as usize && failures >= FORK_WINDOW_FAILURES)
    }
}

/// The periods of [`FORK_WATCH_PERIOD`] a [`MemoryWatch`] judges together:
/// 3 s.
const MEMORY_STALL_PERIODS: usize = 30;

/// Tells a command that thrashes at its memory limit from one that meets
/// it and goes on (a build whose page cache fills the limit and is
/// reclaimed cheaply): fed [`ExecCgroup::memory_stall`] every
/// [`FORK_WATCH_PERIOD`], it says to stop the command once, over the last
/// [`MEMORY_STALL_PERIODS`] periods, all of its processes were stalled on
/// memory for at least half the time and the limit was met in at least a
/// third of the periods (a thrashing command waits on slow reads between
/// its attempts, so not in every one). Without swap, a memory bomb whose
/// binary's pages the kernel can still drop and read back may thrash like
/// this for minutes before the OOM killer ends it, holding the sandbox's
/// memory and CPU meanwhile.
#[derive(Debug)]
pub struct MemoryWatch {
    last: Option<(u64, u64)>,
    /// Per period of the window: time stalled, and whether the limit was met.
    window: std::collections::VecDeque<(Duration, bool)>,
}

impl MemoryWatch {
    /// Starts from the cgroup's figures when the command started.
    pub fn new(baseline: Option<(u64, u64)>) -> Self {
        Self { last: baseline, window: std::collections::VecDeque::with_capacity(MEMORY_STALL_PERIODS) }
    }

    /// Takes the figures now, `period` after the last; `true` when the
    /// command is to be stopped.
    pub fn observe(&mut self, now: Option<(u64, u64)>, period: Duration) -> bool {
        let seen = match (self.last, now) {
            (Some((stall_then, max_then)), Some((stall_now, max_now))) => {
                Some((Duration::from_micros(stall_now.saturating_sub(stall_then)), max_now > max_then))
            }
            _ => None,
        };
        self.last = now;
        let Some(seen) = seen else {
            self.window.clear();
            return false;
        };
        if self.window.len() == MEMORY_STALL_PERIODS {
            self.window.pop_front();
        }
        self.window.push_back(seen);
        let stalled: Duration = self.window.iter().map(|(stall, _)| *stall).sum();
        let met = self.window.iter().filter(|(_, met)| *met).count();
        self.window.len() == MEMORY_STALL_PERIODS
            && stalled * 2 >= period * u32::try_from(MEMORY_STALL_PERIODS).unwrap_or(u32::MAX)
            && met * 3 >= MEMORY_STALL_PERIODS
    }

    /// How long the command was watched stalling, for the report.
    pub fn stalled_for(&self, period: Duration) -> Duration {
        period * u32::try_from(self.window.len()).unwrap_or(u32::MAX)
    }
}

/// Writes the report of a limit reached: which limit, what held it (`top`,
/// from [`ExecCgroup::top_processes`]), what moat did (`killed` processes).
pub fn describe(hit: &LimitHit, top: &str, killed: usize) -> String {
    let plural = |n: u64| if n == 1 { "" } else { "es" };
    let (what, advice) = match hit {
        LimitHit::Pids { limit } => (
            format!("the sandbox's process limit ({limit} processes): forks failed"),
            "start fewer processes or threads at once",
        ),
        LimitHit::Memory { limit_bytes, kills } => (
            format!(
                "the sandbox's memory limit ({}): the kernel's OOM killer ended {kills} process{} (the largest)",
                limit_bytes.map_or_else(|| "its size".to_owned(), |b| format!("{} MiB", b >> 20)),
                plural(*kills)
            ),
            "use less memory, or create a sandbox with more memory_mib",
        ),
        LimitHit::MemoryStall { limit_bytes, seconds } => (
            format!(
                "the sandbox's memory limit ({}): it stalled there for {seconds} s, the kernel reclaiming instead of \
                 ending it",
                limit_bytes.map_or_else(|| "its size".to_owned(), |b| format!("{} MiB", b >> 20)),
            ),
            "use less memory, or create a sandbox with more memory_mib",
        ),
    };
    let held = if top == NOTHING_LEFT { String::new() } else { format!(" Held by: {top}.") };
    let done = if killed == 0 {
        "Nothing of it is left running".to_owned()
    } else {
        format!("moat killed its {killed} remaining process{}", plural(killed as u64))
    };
    format!(
        "\nmoat: this command reached {what}.{held} {done}; the sandbox is ready for the next command ({advice}).\n"
    )
}

/// The file systems of this sandbox whose files live in memory and count
/// against its memory limit (tmpfs: `/tmp`, `/dev/shm`, `/run`; the root
/// overlay, whose writes a jail keeps in RAM), with the bytes their files
/// use, the largest first: one entry per file system, naming every mount
/// of it (a jail's root overlay reports its disk's figures, which its
/// `/tmp`, `/dev/shm` and `/run` share).
fn files_in_memory() -> Vec<(String, u64)> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return Vec::new() };
    /// One file system: its figures (the same for every mount of it), its
    /// mounts, the bytes its files use.
    struct Found<'a> {
        figures: (u64, u64, u64, u64),
        points: Vec<&'a str>,
        bytes: u64,
    }
    let mut found: Vec<Found<'_>> = Vec::new();
    for line in info.lines() {
        // `ID PARENT MAJ:MIN ROOT POINT OPTIONS… - TYPE SOURCE OPTIONS`
        let Some((head, tail)) = line.split_once(" - ") else { continue };
        let (Some(point), Some(kind)) = (head.split(' ').nth(4), tail.split(' ').next()) else { continue };
        if !matches!(kind, "tmpfs" | "overlay") {
            continue;
        }
        let Ok(stat) = nix::sys::statvfs::statvfs(point) else { continue };
        let bytes = stat.blocks().saturating_sub(stat.blocks_free()).saturating_mul(stat.fragment_size());
        let figures = (stat.blocks(), stat.blocks_free(), stat.files(), stat.files_free());
        match found.iter_mut().find(|fs| fs.figures == figures) {
            Some(fs) => fs.points.push(point),
            None if bytes > 0 => found.push(Found { figures, points: vec![point], bytes }),
            None => {}
        }
    }
    found.sort_by_key(|fs| std::cmp::Reverse(fs.bytes));
    found.into_iter().map(|fs| (fs.points.join(", "), fs.bytes)).collect()
}

/// After a memory limit was met: what files hold of it, when they hold an
/// eighth of the limit or more (killing processes frees none of it, so
/// the next commands meet the limit again until the files go). `used`
/// ([`files_in_memory`]) is asked only after a memory limit.
fn files_note(hit: &LimitHit, used: impl FnOnce() -> Vec<(String, u64)>) -> Option<String> {
    let (LimitHit::Memory { limit_bytes, .. } | LimitHit::MemoryStall { limit_bytes, .. }) = hit else {
        return None;
    };
    let used = used();
    let total: u64 = used.iter().map(|(_, bytes)| bytes).sum();
    if total == 0 || limit_bytes.is_some_and(|limit| total < limit / 8) {
        return None;
    }
    let each: Vec<String> =
        used.iter().take(REPORTED).map(|(points, bytes)| format!("{points}: {} MiB", bytes >> 20)).collect();
    Some(format!(
        "moat: files hold {} MiB of that memory ({}): files in this sandbox's /tmp, /dev/shm and /run, and what \
         it writes to its disk, live in memory; delete those not needed, or the next commands meet the limit again.\n",
        total >> 20,
        each.join("; ")
    ))
}

/// What a sandbox cooling down may do, in words.
fn cooling_words(limit: u64) -> String {
    format!(
        "for the next {} s this sandbox's commands may run at most {limit} processes at once, since moat had to kill \
         a command that ran away at its process limit",
        COOLING.as_secs()
    )
}

/// The counter and limit files of the cgroups (`pids.events`,
/// `memory.oom_control` or `memory.events`, `pids.max`), kept open: each
/// command reads several of them when it starts and when it ends, and a
/// read at offset 0 of an open cgroup file shows its content now, without
/// the path walk through the cgroup file system, the open and the close
/// that were most of the agent's system time per command. Not
/// `cgroup.procs`: cgroup v1 answers a second read of an open one from the
/// list it made for the first, for up to a second. A cgroup's files are
/// closed when it is removed (an open file keeps a removed cgroup's kernel
/// state alive), and a file that fails to read is closed and opened again
/// next time.
static OPEN_FILES: Mutex<std::collections::BTreeMap<PathBuf, std::sync::Arc<std::fs::File>>> =
    Mutex::new(std::collections::BTreeMap::new());

fn open_files() -> MutexGuard<'static, std::collections::BTreeMap<PathBuf, std::sync::Arc<std::fs::File>>> {
    // Each critical section is one map operation: a panic leaves it whole.
    OPEN_FILES.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The content of the counter or limit file `path`, read through its kept
/// descriptor ([`OPEN_FILES`]).
fn read_counter_file(path: &Path) -> std::io::Result<String> {
    use std::os::unix::fs::FileExt;
    let cached = open_files().get(path).cloned();
    let file = match cached {
        Some(file) => file,
        None => {
            let file = std::sync::Arc::new(std::fs::File::open(path)?);
            open_files().insert(path.to_path_buf(), file.clone());
            file
        }
    };
    let mut text = Vec::new();
    let mut chunk = [0u8; 4096];
    let read = loop {
        match file.read_at(&mut chunk, text.len() as u64) {
            Ok(0) => break Ok(()),
            Ok(n) => text.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    if let Err(e) = read {
        open_files().remove(path);
        return Err(e);
    }
    String::from_utf8(text).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Closes the kept files of cgroup `dir` ([`OPEN_FILES`]).
fn close_counter_files(dir: &Path) {
    open_files().retain(|path, _| !path.starts_with(dir));
}

/// Reads `key N` from a flat-keyed cgroup file; 0 when absent.
fn counter(file: &Path, key: &str) -> u64 {
    read_counter_file(file)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or(0)
}

/// A process's resident KiB and its threads, from `/proc/PID/status`
/// (0 and 0 once it is gone).
fn status_figures(pid: i32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()))
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("Threads:"))
}

/// Moves the calling process into the cgroups whose `cgroup.procs` files
/// `fds` are. Runs in a command's child before its exec
/// ([`crate::spawn`]): one `write(2)` per file, nothing that allocates or
/// locks.
pub fn join(fds: &[i32]) -> std::io::Result<()> {
    for &fd in fds {
        // SAFETY: `fd` is an open descriptor the parent opened for this
        // child; write(2) reads the one static byte and is
        // async-signal-safe.
        if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guests_process_limit_follows_its_memory() {
        assert_eq!(guest_pids(4 << 30), 960, "a large guest: the jail's figure");
        assert_eq!(guest_pids(190 << 20), 190, "a small guest: one per MiB");
        assert_eq!(guest_pids(1 << 20), 64, "never below the reserve's size");
    }

    #[test]
    fn counters_are_read_by_key() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let file = dir.path().join("memory.oom_control");
        std::fs::write(&file, "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n").expect("write");
        assert_eq!(counter(&file, "oom_kill"), 2);
        assert_eq!(counter(&file, "max"), 0);
    }

    /// A kept counter file shows each change (a cgroup file's content is
    /// made anew at each read from its start), and goes with its cgroup.
    #[test]
    fn kept_counter_files_show_the_content_now() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let file = dir.path().join("pids.events");
        std::fs::write(&file, "max 1\n").expect("write");
        assert_eq!(counter(&file, "max"), 1);
        std::fs::write(&file, "max 12345\n").expect("write");
        assert_eq!(counter(&file, "max"), 12345);
        close_counter_files(dir.path());
        assert!(!open_files().contains_key(&file), "closed with its cgroup");
        // A real cgroup's, where the host lets this test make one.
        let root = Path::new("/sys/fs/cgroup/pids");
        let cgroup = root.join(format!("moat-kept-files-{}", std::process::id()));
        if root.join("cgroup.procs").exists() && std::fs::create_dir(&cgroup).is_ok() {
            let max = cgroup.join("pids.max");
            let first = read_counter_file(&max).map(|m| m.trim().to_owned());
            let _ = std::fs::write(&max, "7");
            let second = read_counter_file(&max).map(|m| m.trim().to_owned());
            close_counter_files(&cgroup);
            std::fs::remove_dir(&cgroup).expect("the test's cgroup is removed");
            assert_eq!((first.expect("read").as_str(), second.expect("read again").as_str()), ("max", "7"));
        }
    }

    #[test]
    fn a_limit_report_says_which_limit_what_held_it_and_what_was_done() {
        let pids = describe(&LimitHit::Pids { limit: "960".into() }, "bash ×957, 3 MiB resident", 957);
        for words in
            ["process limit (960 processes)", "Held by: bash ×957", "killed its 957 remaining processes", "ready"]
        {
            assert!(pids.contains(words), "{words:?} missing from {pids}");
        }
        let memory = describe(&LimitHit::Memory { limit_bytes: Some(512 << 20), kills: 1 }, NOTHING_LEFT, 0);
        assert!(!memory.contains("Held by"), "{memory}");
        for words in ["memory limit (512 MiB)", "OOM killer ended 1 process (the largest)", "Nothing of it is left"] {
            assert!(memory.contains(words), "{words:?} missing from {memory}");
        }
    }

    #[test]
    fn a_command_thrashing_at_its_memory_limit_is_stopped_and_one_reclaiming_cheaply_is_not() {
        let period = FORK_WATCH_PERIOD;
        let periods = u64::try_from(MEMORY_STALL_PERIODS).expect("small");
        let stall = u64::try_from(period.as_micros()).expect("small") * 6 / 10;
        // Stalled 60 % of the time, the limit met every other period:
        // stopped once the window is full (3 s).
        let mut bomb = MemoryWatch::new(Some((0, 0)));
        for n in 1..periods {
            assert!(!bomb.observe(Some((stall * n, n / 2)), period), "period {n}");
        }
        assert!(bomb.observe(Some((stall * periods, periods / 2 + 1)), period));
        assert_eq!(bomb.stalled_for(period), Duration::from_secs(3));
        // At the limit every period, but its page cache reclaimed cheaply
        // (10 % stalled): a build, kept running.
        let mut build = MemoryWatch::new(Some((0, 0)));
        for n in 1..200u64 {
            assert!(!build.observe(Some((n * stall / 6, n)), period), "period {n}");
        }
        // Stalled (on I/O, say) without meeting the limit: not a memory bomb.
        let mut waiting = MemoryWatch::new(Some((0, 0)));
        for n in 1..200u64 {
            assert!(!waiting.observe(Some((n * stall, n / 10)), period), "the limit met one period in ten");
        }
        // cgroup v1: no pressure, no watch.
        let mut v1 = MemoryWatch::new(None);
        assert!((0..100).all(|_| !v1.observe(None, period)));
        let report = describe(&LimitHit::MemoryStall { limit_bytes: Some(448 << 20), seconds: 3 }, "python3 ×1", 1);
        for words in ["memory limit (448 MiB): it stalled there for 3 s", "Held by: python3", "killed its 1 remaining"]
        {
            assert!(report.contains(words), "{words:?} missing from {report}");
        }
    }

    #[test]
    fn a_fork_bomb_is_stopped_and_a_burst_at_the_limit_is_not() {
        // Forks failing in three periods in a row: a fork bomb.
        let mut bomb = ForkWatch::new(5);
        assert!(!bomb.observe(5), "nothing failed since the start");
        assert!(!bomb.observe(900));
        assert!(!bomb.observe(2400));
        assert!(bomb.observe(4100));
        // A build that meets the limit now and then keeps running.
        let mut burst = ForkWatch::new(0);
        for failed in [0, 3, 3, 7, 9, 9, 9, 12, 12, 12, 12, 15, 15, 20, 20, 20, 20, 20, 24] {
            assert!(!burst.observe(failed), "stopped at {failed}");
        }
        // A bomb of shells at a limit of 60, whose forks fail in bursts
        // between the shells' pauses (as measured), is stopped at its
        // third burst.
        let mut shells = ForkWatch::new(0);
        let mut failed = 0;
        for period in 0..29 {
            failed += match period {
                0 | 10 => 36,
                _ => 0,
            };
            assert!(!shells.observe(failed), "stopped in period {period}");
        }
        assert!(shells.observe(failed + 51), "not stopped after bursts of 36, 36 and 51 failed forks");
    }

    #[test]
    fn a_sandbox_cools_down_after_a_runaway_with_a_lower_pids_limit_for_its_commands() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let pids = dir.path().join("pids");
        std::fs::create_dir_all(pids.join("exec-1")).expect("made");
        std::fs::write(pids.join("cgroup.procs"), "").expect("written");
        std::fs::write(pids.join("pids.max"), "960\n").expect("written");
        std::fs::write(pids.join("exec-1/pids.max"), "960\n").expect("written");
        let cgroups = UserCgroups::discover(dir.path()).expect("found");
        let exec = ExecCgroup::existing(&cgroups.hierarchies, "exec-1");
        let limit = || std::fs::read_to_string(pids.join("exec-1/pids.max")).expect("read").trim().to_owned();
        cgroups.set_pids_limit(&exec);
        assert_eq!((limit(), cgroups.cooling()), ("960".into(), None));
        // The first runaway lowers the limit; its next command waits not.
        assert_eq!(cgroups.cool_down(), Cooled { limit: Some(60), hold: None });
        assert_eq!(cgroups.hold(), None);
        cgroups.set_pids_limit(&exec);
        assert_eq!((limit(), cgroups.cooling()), ("60".into(), Some(60)));
        // Runaways again while cooling down: the next command waits, twice
        // as long each time, up to the most.
        let holds: Vec<_> = (0..6).map(|_| cgroups.cool_down().hold.map(|hold| hold.as_secs())).collect();
        assert_eq!(holds, [Some(1), Some(2), Some(4), Some(8), Some(8), Some(8)]);
        assert!(cgroups.hold().is_some_and(|hold| hold > Duration::from_secs(7)), "{:?}", cgroups.hold());
        let words = cgroups.cool_down().words().expect("words");
        for part in ["at most 60 processes", "its next command starts after 8 s"] {
            assert!(words.contains(part), "{part:?} missing from {words}");
        }
        // Once the time has passed, commands start with the whole limit
        // and at once, and a runaway starts the count again.
        cgroups.cooling.lock().expect("unpoisoned").until = Some(Instant::now() - Duration::from_secs(1));
        cgroups.set_pids_limit(&exec);
        assert_eq!((limit(), cgroups.cooling(), cgroups.hold()), ("960".into(), None, None));
        assert_eq!(cgroups.cool_down(), Cooled { limit: Some(60), hold: None });
        // A small limit keeps a floor, and never grows.
        std::fs::write(pids.join("pids.max"), "200\n").expect("written");
        assert_eq!(cgroups.cool_down().limit, Some(COOLING_FLOOR));
        std::fs::write(pids.join("pids.max"), "20\n").expect("written");
        assert_eq!(cgroups.cool_down().limit, Some(20));
        // No limit, nothing to lower.
        std::fs::write(pids.join("pids.max"), "max\n").expect("written");
        assert_eq!(cgroups.cool_down().words(), None);
    }

    #[test]
    fn commands_that_fill_the_shared_limit_together_are_told_apart_by_size() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let pids = dir.path().join("pids");
        for (exec, procs) in [("exec-1", "10\n11\n12\n"), ("exec-2", "20\n21\n22\n23\n24\n"), ("exec-3", "")] {
            std::fs::create_dir_all(pids.join(exec)).expect("made");
            std::fs::write(pids.join(exec).join("cgroup.procs"), procs).expect("written");
        }
        std::fs::write(pids.join("cgroup.procs"), "").expect("written");
        std::fs::write(pids.join("pids.max"), "960\n").expect("written");
        std::fs::write(pids.join("pids.events"), "max 4100\n").expect("written");
        let cgroups = UserCgroups::discover(dir.path()).expect("found");
        assert_eq!(cgroups.failed_forks(), 4100);
        let holds = |name| cgroups.holds_the_most(&ExecCgroup::existing(&cgroups.hierarchies, name));
        assert_eq!((holds("exec-1"), holds("exec-2"), holds("exec-3")), (false, true, false));
        // Counted in tasks, as the limit counts them: one process of 900
        // threads holds more than five of one thread each.
        std::fs::create_dir_all(pids.join("exec-4")).expect("made");
        std::fs::write(pids.join("exec-4").join("cgroup.procs"), "40\n").expect("written");
        std::fs::write(pids.join("exec-4").join("pids.current"), "900\n").expect("written");
        std::fs::write(pids.join("exec-2").join("pids.current"), "5\n").expect("written");
        assert_eq!((holds("exec-2"), holds("exec-4")), (false, true));
        let report = describe(&cgroups.shared_pids_hit(), "bash ×5", 5);
        assert!(report.contains("process limit (960 processes)"), "{report}");
    }

    #[test]
    fn files_that_hold_memory_are_named_after_a_memory_limit() {
        let hit = LimitHit::Memory { limit_bytes: Some(3008 << 20), kills: 1 };
        let used = [("/, /tmp, /run".to_owned(), 2000 << 20), ("/dev/shm".to_owned(), 1000 << 20)];
        let note = files_note(&hit, || used.to_vec()).expect("a note");
        for words in ["files hold 3000 MiB", "(/, /tmp, /run: 2000 MiB; /dev/shm: 1000 MiB)", "delete those not needed"]
        {
            assert!(note.contains(words), "{words:?} missing: {note}");
        }
        // Little of the limit, or another limit: no note.
        assert_eq!(files_note(&hit, || vec![("/tmp".to_owned(), 100 << 20)]), None);
        assert_eq!(files_note(&LimitHit::Pids { limit: "960".into() }, || used.to_vec()), None);
    }

    /// A `user` cgroup made for a test in the host's `pids` hierarchy
    /// (cgroup v1) or its unified one, bound as a sandbox's would be;
    /// removed, with what the test made in it, at its end. `None` where
    /// the host lets this test make none (not root, no such hierarchy).
    struct TestUserCgroup {
        dir: PathBuf,
        bound: tempfile::TempDir,
    }

    impl TestUserCgroup {
        fn make(test: &str) -> Option<Self> {
            let (hierarchy, name) = [("/sys/fs/cgroup/pids", "pids"), ("/sys/fs/cgroup", UNIFIED)]
                .into_iter()
                .find(|(dir, _)| Path::new(dir).join("cgroup.procs").exists())?;
            let dir = Path::new(hierarchy).join(format!("moat-{test}-{}", std::process::id()));
            std::fs::create_dir(&dir).ok()?;
            let bound = tempfile::tempdir().ok()?;
            std::os::unix::fs::symlink(&dir, bound.path().join(name)).ok()?;
            Some(Self { dir, bound })
        }
    }

    impl Drop for TestUserCgroup {
        fn drop(&mut self) {
            for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
                if entry.path().is_dir() {
                    let _ = std::fs::remove_dir(entry.path());
                }
            }
            let _ = std::fs::remove_dir(&self.dir);
        }
    }

    /// A command cgroup has one owner at a time: one being made for a
    /// command is never found idle by a pass that lists the directories
    /// meanwhile (a sweep, a reclaim) and kept free for another command
    /// too. (It was, in the moment between its directory and its name:
    /// two commands were later handed the one cgroup, and a kill meant
    /// for what one left took the other and its launcher.)
    #[test]
    fn a_cgroup_being_made_is_never_kept_free_for_another_command() {
        let Some(user) = TestUserCgroup::make("claims") else {
            eprintln!("skipped: this host lets the test make no cgroup (run as root on a host with cgroups)");
            return;
        };
        let cgroups: &'static UserCgroups =
            Box::leak(Box::new(UserCgroups::discover(user.bound.path()).expect("the test's cgroup is found")));
        let reaper = std::sync::Arc::new(Reaper::default());
        let done = std::sync::atomic::AtomicBool::new(false);
        let (mut made, mut kept_free_too) = (0, 0);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !done.load(Ordering::SeqCst) {
                    cgroups.sweep();
                }
            });
            for _ in 0..2000 {
                let exec = cgroups.create_exec(&reaper).expect("a command cgroup is made");
                made += 1;
                if cgroups.names().free.iter().any(|(free, _)| *free == exec.name) {
                    kept_free_too += 1;
                }
                // Gone before its name is given up: the next is made anew.
                exec.remove();
                drop(exec);
            }
            done.store(true, Ordering::SeqCst);
        });
        assert_eq!(kept_free_too, 0, "of {made} cgroups given to commands, {kept_free_too} were kept free as well");
    }

    #[test]
    fn no_bound_directory_means_no_command_cgroups() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        assert!(UserCgroups::discover(&dir.path().join("absent")).is_none());
        assert!(UserCgroups::discover(dir.path()).is_none());
    }
}
