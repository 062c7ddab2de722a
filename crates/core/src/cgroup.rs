//! Resource limits and freezing through cgroups, v2 or v1.
//!
//! A sandbox gets its own cgroup (`moat/<id>`) with a memory, pids and CPU
//! limit; suspending it freezes the cgroup. On a v1 host each controller is
//! its own hierarchy. What the host does not offer is skipped, and
//! [`CgroupSupport::probe`] says so for `moat doctor`.
//!
//! The sandbox's cgroup is split in two: `agent` holds the agent (and
//! the jail's monitor), `user` every process the agent starts, with the
//! sandbox's pids and memory limits minus [`RESERVE_PIDS`] and
//! [`RESERVE_MEMORY`]: whatever the commands do, the agent keeps that much
//! to act with. The agent owns the `user` directory (not its limit files)
//! and makes one cgroup per command beneath it (`moat_agent::cgroup`).
//! On v1 the split is made here; on v2 the jail's monitor finishes it
//! ([`Cgroup::split_line`]): there processes live only in leaves, and the
//! sandbox's cgroup namespace must be rooted above both halves.
//! For the CPU, `user` and `agent` each have the sandbox's quota of
//! `cpus` (not one quota for both: a fork bomb's kernel time, charged
//! but throttled only when it returns to user space, would use up a shared
//! one and throttle the agent), and the agent weighs [`AGENT_CPU_SHARES`]
//! (v1; `AGENT_CPU_WEIGHT` in the agent's terms on v2) against the
//! commands' 1024: a sandbox whose commands spin (a fork bomb spinning at
//! the pids limit) still has an agent that answers, times out and kills.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use moat_sys::cgroupfs::{self, Busy};

use crate::process::Pidfd;

const ROOT: &str = "/sys/fs/cgroup";

/// How this host exposes cgroups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupSupport {
    /// The unified hierarchy.
    V2,
    /// Per-controller hierarchies; the list says which of ours exist.
    V1 {
        controllers: Vec<&'static str>,
    },
    None,
}

const V1_CONTROLLERS: &[&str] = &["memory", "pids", "cpu", "freezer"];

impl CgroupSupport {
    pub fn probe() -> Self {
        if Path::new(ROOT).join("cgroup.controllers").exists() {
            return Self::V2;
        }
        let controllers: Vec<_> =
            V1_CONTROLLERS.iter().copied().filter(|c| Path::new(ROOT).join(c).join("tasks").exists()).collect();
        if controllers.is_empty() { Self::None } else { Self::V1 { controllers } }
    }

    /// Whether this process may make sandbox cgroups here; the reason when not.
    pub fn writable(&self) -> Result<(), String> {
        let dirs: Vec<PathBuf> = match self {
            Self::None => return Err("this host has no cgroups".into()),
            Self::V2 => vec![Path::new(ROOT).to_path_buf()],
            Self::V1 { controllers } => controllers.iter().map(|c| Path::new(ROOT).join(c)).collect(),
        };
        let uid = nix::unistd::geteuid().as_raw();
        if *self == Self::V2 && uid != 0 {
            return delegated_v2().as_ref().map(|_| ()).map_err(Clone::clone);
        }
        for dir in dirs {
            // The parent made already (by root) or the hierarchy to make it in.
            let parent = parent_in(&dir, uid);
            let check = if parent.is_dir() || uid != 0 { parent } else { dir };
            if let Err(e) = nix::unistd::access(&check, nix::unistd::AccessFlags::W_OK) {
                let fix = if uid == 0 {
                    String::new()
                } else {
                    let name = crate::hostuser::HostUser::current().display_name();
                    format!("; as root, run `moat setup --user {name}` to delegate it")
                };
                return Err(format!("this user cannot make cgroups in {} ({e}){fix}", check.display()));
            }
        }
        Ok(())
    }

    /// What limits hold here, in words.
    pub fn describe(&self) -> String {
        match self {
            Self::V2 => format!(
                "cgroup v2: memory, pids and CPU limits; freezing idle sandboxes; commands run in a user cgroup \
                 beside the agent's reserve ({RESERVE_PIDS} processes, {} MiB), one cgroup per command",
                RESERVE_MEMORY >> 20
            ),
            Self::V1 { controllers } => format!(
                "cgroup v1 with {}; commands run in a user cgroup beside the agent's reserve ({RESERVE_PIDS} \
                 processes, {} MiB), one cgroup per command",
                controllers.join(", "),
                RESERVE_MEMORY >> 20
            ),
            Self::None => "no cgroups: sandboxes run without memory, pids or CPU limits and cannot be frozen".into(),
        }
    }
}

/// Processes the sandbox's commands cannot take from the agent.
pub const RESERVE_PIDS: u32 = 64;

/// Memory the sandbox's commands cannot take from the agent.
pub const RESERVE_MEMORY: u64 = 64 << 20;

/// The agent's CPU weight (`cpu.shares`) within its sandbox, against the
/// 1024 (the kernel's default) of all the sandbox's commands together. The
/// agent spends little CPU, but must get it at once: 960 spinning commands
/// in its own cgroup would leave it one share in 961.
pub const AGENT_CPU_SHARES: u32 = 4096;

/// The controllers whose `user` cgroup the agent gets, to make per-command
/// cgroups in: the limits it reports on, the freezer it kills with, and the
/// CPU hierarchy that keeps the commands out of the agent's CPU share.
const USER_CONTROLLERS: &[&str] = &["memory", "pids", "freezer", "cpu"];

/// Limits for one sandbox.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub memory_bytes: u64,
    pub pids: u32,
    pub cpus: u32,
}

/// One sandbox's cgroup(s).
#[derive(Debug)]
pub struct Cgroup {
    /// The directories made, one per hierarchy (one on v2).
    dirs: Vec<(Option<&'static str>, PathBuf)>,
    v2: bool,
    /// Whether `agent` and `user` children were made.
    split: bool,
    /// Rootless: what removes the cgroups sandbox root made, which the
    /// user may not (see [`Sweeper`]).
    sweeper: Option<Arc<Sweeper>>,
}

impl Limits {
    /// The limits of the `user` cgroup: the sandbox's less the agent's reserve
    /// (at most half of each, for very small sandboxes).
    pub fn user(&self) -> (u64, u32) {
        let memory = self.memory_bytes - RESERVE_MEMORY.min(self.memory_bytes / 2);
        let pids = self.pids - RESERVE_PIDS.min(self.pids / 2);
        (memory, pids)
    }
}

/// Makes a sandbox's cgroup, which must be new: one there already is
/// another's (a sandbox of another moat under the same `moat` directory
/// whose id this one drew), never to be shared, limited or removed as
/// this sandbox's. The error's kind is then `AlreadyExists`.
fn create_own(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir(dir).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            std::io::Error::new(
                e.kind(),
                format!("{} exists already: another sandbox's cgroup; create the sandbox again", dir.display()),
            )
        } else {
            e
        }
    })
}

impl Cgroup {
    /// Creates `moat/<id>` (for a user other than root, beneath its
    /// delegated `moat/user-<uid>`) with `limits`; on v1 also its `agent`
    /// and `user` children, `user` owned by `agent_uid` (the host uid of the
    /// sandbox's root) when given. Errors say which file refused.
    pub fn create(
        support: &CgroupSupport,
        id: &str,
        limits: Limits,
        agent_uid: Option<u32>,
    ) -> std::io::Result<Option<Self>> {
        let cpu_max = format!("{} 100000", u64::from(limits.cpus.max(1)) * 100_000);
        match support {
            CgroupSupport::None => Ok(None),
            CgroupSupport::V2 => {
                if !nix::unistd::geteuid().is_root()
                    && let Err(e) = delegated_v2()
                {
                    return Err(std::io::Error::other(e.clone()));
                }
                let parent = parent(Path::new(ROOT));
                if nix::unistd::geteuid().is_root() {
                    std::fs::create_dir_all(&parent)?;
                    // Controllers must be enabled on every level above the leaf.
                    for level in [Path::new(ROOT), parent.as_path()] {
                        let _ = enable_controllers(level, true);
                    }
                }
                let dir = parent.join(id);
                create_own(&dir)?;
                let group = Self { dirs: vec![(None, dir.clone())], v2: true, split: true, sweeper: None };
                write(&dir, "memory.max", &limits.memory_bytes.to_string())?;
                let _ = write(&dir, "memory.swap.max", "0");
                write(&dir, "pids.max", &limits.pids.to_string())?;
                let _ = write(&dir, "cpu.max", &cpu_max);
                // The split is finished by the jail's monitor (see
                // `split_line`): v2 keeps processes only in leaves once a
                // cgroup enables controllers for its children, and the
                // sandbox's cgroup namespace must be rooted here, above
                // both halves, for the agent to move its commands into
                // `user`.
                std::fs::create_dir_all(dir.join("agent"))?;
                std::fs::create_dir_all(dir.join("user"))?;
                Ok(Some(group))
            }
            CgroupSupport::V1 { controllers } => {
                let mut group = Self { dirs: Vec::new(), v2: false, split: true, sweeper: None };
                for controller in controllers {
                    let dir = parent(&Path::new(ROOT).join(controller)).join(id);
                    // Root makes `moat` as needed; a delegated user's
                    // parent (`moat setup --user`) must be there already.
                    if nix::unistd::geteuid().is_root()
                        && let Some(parent) = dir.parent()
                    {
                        std::fs::create_dir_all(parent)?;
                    }
                    if let Err(e) = create_own(&dir) {
                        // Another's: what this create made goes, nothing more.
                        for (_, made) in &group.dirs {
                            for child in ["agent", "user", ""] {
                                let _ = std::fs::remove_dir(made.join(child));
                            }
                        }
                        return Err(e);
                    }
                    group.dirs.push((Some(*controller), dir.clone()));
                    let user = dir.join("user");
                    std::fs::create_dir_all(dir.join("agent"))?;
                    std::fs::create_dir_all(&user)?;
                    for setting in v1_settings(controller, limits) {
                        let result = write(&dir.join(setting.child), setting.file, &setting.value);
                        if setting.required {
                            result?;
                        }
                    }
                    // The agent makes its per-command cgroups here; the
                    // limit files stay root's. Rootless, the jail's monitor
                    // gives it (only it may chown to the user's
                    // subordinate ids).
                    if let Some(agent_uid) = agent_uid {
                        let owner = Some(nix::unistd::Uid::from_raw(agent_uid));
                        nix::unistd::chown(&user, owner, Some(nix::unistd::Gid::from_raw(agent_uid)))
                            .map_err(|e| std::io::Error::other(format!("giving the sandbox its user cgroup: {e}")))?;
                    }
                }
                Ok(Some(group))
            }
        }
    }

    /// The `cgroup.procs` files the jail's monitor (and so the agent)
    /// writes its pid to, to join. On v2 that is the sandbox's cgroup
    /// itself, left for `agent` once the sandbox is cloned (see
    /// [`Cgroup::split_line`]).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        let leaf = if self.split && !self.v2 { "agent/cgroup.procs" } else { "cgroup.procs" };
        self.dirs.iter().map(|(_, d)| d.join(leaf)).collect()
    }

    /// On v2, what the jail's monitor needs to finish the split after it
    /// cloned the sandbox (its cgroup namespace then rooted at the
    /// sandbox's cgroup): the line `split <dir> <user memory bytes> <user
    /// pids>`. It moves itself and the sandbox into `agent`, enables the
    /// controllers below, sets `user`'s limits and gives the agent what it
    /// needs to make and join per-command cgroups in `user`.
    pub fn split_line(&self, limits: Limits) -> Option<String> {
        let (_, dir) = self.dirs.first().filter(|_| self.v2 && self.split)?;
        let (memory, pids) = limits.user();
        Some(format!("split {} {memory} {pids}", dir.display()))
    }

    /// The `user` cgroups the agent makes per-command cgroups in, by
    /// controller name; empty when the cgroup is not split.
    pub fn user_dirs(&self) -> Vec<(&'static str, PathBuf)> {
        if !self.split {
            return Vec::new();
        }
        if self.v2 {
            return self.dirs.iter().map(|(_, d)| ("unified", d.join("user"))).collect();
        }
        self.dirs
            .iter()
            .filter_map(|(c, d)| c.filter(|c| USER_CONTROLLERS.contains(c)).map(|c| (c, d.join("user"))))
            .collect()
    }

    /// Whether freezing works here.
    pub fn can_freeze(&self) -> bool {
        self.v2 || self.dirs.iter().any(|(c, _)| *c == Some("freezer"))
    }

    /// Freezes (`true`) or thaws every process of the sandbox.
    pub fn set_frozen(&self, frozen: bool) -> std::io::Result<()> {
        for (controller, dir) in &self.dirs {
            match (self.v2, controller) {
                (true, _) => write(dir, "cgroup.freeze", if frozen { "1" } else { "0" })?,
                (false, Some("freezer")) => write(dir, "freezer.state", if frozen { "FROZEN" } else { "THAWED" })?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Rootless: `sweeper` removes what the user may not (see [`Sweeper`]).
    #[must_use]
    pub fn with_sweeper(mut self, sweeper: Option<Arc<Sweeper>>) -> Self {
        self.sweeper = sweeper;
        self
    }

    /// Removes the cgroup directories, children first, at any depth. What
    /// is still in them (a process the pid namespace's end has not taken
    /// yet, or one frozen by a command's kill that never finished) is
    /// thawed, killed and waited for.
    /// Whether every tree went (and every process in them with it).
    pub fn remove(&self) -> bool {
        let dirs: Vec<&Path> = self.dirs.iter().map(|(_, d)| d.as_path()).collect();
        remove_trees(&dirs, self.sweeper.as_deref())
    }

    /// Removes the cgroups of sandbox `id` left by a dead owner.
    pub fn remove_leftovers(id: &str, sweeper: Option<&Sweeper>) {
        let dirs = sandbox_dirs(id);
        let dirs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).filter(|d| d.exists()).collect();
        remove_trees(&dirs, sweeper);
    }
}

/// Thaws, empties and removes the sandbox cgroups `dirs` (one per
/// hierarchy); what the user may not remove is left to `sweeper`. Whether
/// all went.
fn remove_trees(dirs: &[&Path], sweeper: Option<&Sweeper>) -> bool {
    // Every tree is thawed before any is emptied: a process frozen in
    // the freezer's hierarchy holds its cgroups in the others. One
    // refused is for the sweeper (or, first, the jail's keeper).
    for dir in dirs {
        let _ = cgroupfs::thaw(dir);
    }
    let deadline = Instant::now() + REMOVE_GUARD;
    let mut left = Vec::new();
    for dir in dirs {
        if let Err(e) = cgroupfs::remove(dir, Busy::Kill, deadline) {
            left.push((*dir, e));
        }
    }
    if let Some(sweeper) = sweeper
        && left.iter().any(|(_, e)| e.is_refused())
    {
        let trees: Vec<&Path> = left.iter().map(|(dir, _)| *dir).collect();
        match sweeper.run(&trees) {
            Ok(()) => return true,
            Err(why) => tracing::warn!("moat-agent cgroup-sweep could not remove a sandbox's cgroups: {why}"),
        }
    }
    let all = left.is_empty();
    for (dir, e) in left {
        tracing::warn!(dir = %dir.display(), "could not remove a sandbox cgroup: {e}");
    }
    all
}

/// How long the sweeper may take: its own guard on emptying the trees,
/// and the time to enter the user's namespace.
const SWEEP_GUARD: Duration = Duration::from_secs(30);

/// Rootless: `moat-agent cgroup-sweep` (`moat_agent::cgroup_sweep`), the
/// program that removes a sandbox's cgroups with the rights of the user's
/// subordinate ids. A rootless sandbox's command cgroups belong to its
/// root, one of those ids, and sandbox root may make cgroups beneath them
/// that the user can neither remove nor empty. The host removes what it
/// may and runs this only when its own removal is refused, so a sandbox
/// that made none costs nothing more.
#[derive(Debug)]
pub struct Sweeper {
    agent: PathBuf,
    /// `--id-base` and the rest, before the directories.
    args: Vec<OsString>,
}

impl Sweeper {
    /// The sweeper `agent` runs with `args` (the user's ranges and
    /// namespace holder, as its jails' monitors are given them).
    pub fn new(agent: PathBuf, args: Vec<OsString>) -> Self {
        Self { agent, args }
    }

    /// Removes `dirs`; what the program said when it could not.
    fn run(&self, dirs: &[&Path]) -> Result<(), String> {
        let mut child = std::process::Command::new(&self.agent)
            .env_clear()
            .envs(crate::process::helper_env())
            .arg("cgroup-sweep")
            .args(&self.args)
            .args(dirs)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.agent.display()))?;
        if let Ok(exit) = Pidfd::of(&child)
            && !exit.wait_timeout(SWEEP_GUARD)
        {
            let _ = child.kill();
        }
        let out = child.wait_with_output().map_err(|e| format!("waiting for {}: {e}", self.agent.display()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("{} ({})", String::from_utf8_lossy(&out.stderr).trim(), out.status))
        }
    }
}

/// One file a v1 sandbox cgroup is set up with.
#[derive(Debug, PartialEq, Eq)]
struct Setting {
    /// `""` for the sandbox's cgroup, else its `agent` or `user` child.
    child: &'static str,
    file: &'static str,
    value: String,
    /// Whether the sandbox is refused when it cannot be written (a limit),
    /// or runs without it (a refinement the host may not offer).
    required: bool,
}

/// What a sandbox's cgroup in the v1 hierarchy `controller` is set up with:
/// the sandbox's limits on the whole, the commands' (the reserve taken
/// off) on `user`, and the agent's CPU weight.
fn v1_settings(controller: &str, limits: Limits) -> Vec<Setting> {
    let set = |child, file, value: String, required| Setting { child, file, value, required };
    let (user_memory, user_pids) = limits.user();
    match controller {
        // v1's memory limit is of RAM alone: where the host swaps, memory
        // past it would go to swap until the host's is full. The limit of
        // RAM and swap together (the file is there where the kernel
        // accounts swap, `swapaccount`) is set to the same, after it (it
        // may not be below the RAM limit): a sandbox swaps nothing.
        "memory" => vec![
            set("", "memory.limit_in_bytes", limits.memory_bytes.to_string(), true),
            set("", "memory.memsw.limit_in_bytes", limits.memory_bytes.to_string(), false),
            set("user", "memory.limit_in_bytes", user_memory.to_string(), true),
            set("user", "memory.memsw.limit_in_bytes", user_memory.to_string(), false),
        ],
        "pids" => {
            vec![
                set("", "pids.max", limits.pids.to_string(), true),
                set("user", "pids.max", user_pids.to_string(), true),
            ]
        }
        // The quota is the commands' and, as much again, the agent's, not
        // one for both: a quota shared with commands that fork and exit
        // in the kernel (a fork bomb, whose kernel time is charged but
        // throttled only when it returns to user space) would throttle
        // the agent that has to stop them.
        "cpu" => {
            let quota = (u64::from(limits.cpus.max(1)) * 100_000).to_string();
            vec![
                set("user", "cpu.cfs_period_us", "100000".into(), false),
                set("user", "cpu.cfs_quota_us", quota.clone(), false),
                set("agent", "cpu.cfs_period_us", "100000".into(), false),
                set("agent", "cpu.cfs_quota_us", quota, false),
                set("agent", "cpu.shares", AGENT_CPU_SHARES.to_string(), false),
            ]
        }
        _ => Vec::new(),
    }
}

/// Where this process's sandboxes' cgroups live in the hierarchy mounted
/// at `hierarchy`: `moat/` for root; for any other user, the subtree root
/// delegated to it (`moat/user-<uid>/`, see [`delegate`]), or on cgroup v2
/// the delegated cgroup it was started in ([`delegated_v2`]). One user's
/// sweeps and listings never reach another's sandboxes.
pub fn parent(hierarchy: &Path) -> PathBuf {
    let uid = nix::unistd::geteuid().as_raw();
    if uid != 0
        && hierarchy == Path::new(ROOT)
        && CgroupSupport::probe() == CgroupSupport::V2
        && let Ok(dir) = delegated_v2()
    {
        return dir.clone();
    }
    parent_in(hierarchy, uid)
}

/// The leaf a process that owns its cgroup moves itself into, so that the
/// cgroup may enable controllers for its sandboxes' cgroups beside it
/// (cgroup v2 keeps processes only in leaves).
pub const SERVER_LEAF: &str = "moat";

/// On cgroup v2, for a user other than root: the cgroup its sandboxes'
/// cgroups are made in, found once per process (the first call may move
/// this process; make it before starting children, as
/// [`prepare`] does). v2 lets a process move another only within a
/// subtree whose `cgroup.procs` it may write and that holds both, so
/// moat must run inside what was delegated to it:
///
/// - below `moat/user-<uid>/`, which root delegated with `moat setup
///   --user` and put this process's session under: its sandboxes go there;
/// - in a cgroup of its own that the user owns, as `systemd-run --user
///   --scope -p Delegate=yes` makes (or `user@UID.service`'s subtree): moat
///   moves itself into its leaf [`SERVER_LEAF`], enables the memory, pids
///   and CPU controllers, and its sandboxes go beside that leaf.
///
/// Anything else is an error that says how to start moat.
pub fn delegated_v2() -> &'static Result<PathBuf, String> {
    static FOUND: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    FOUND.get_or_init(|| {
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup ({e})"))
            .and_then(|text| own_v2_cgroup(&text).ok_or_else(|| "/proc/self/cgroup names no cgroup v2 path".into()))?;
        let found = resolve_v2(Path::new(ROOT), &own, nix::unistd::geteuid().as_raw(), std::process::id());
        match &found {
            Ok(dir) => tracing::debug!(dir = %dir.display(), "sandbox cgroups go in the delegated cgroup"),
            Err(e) => tracing::warn!("no delegated cgroup for sandboxes: {e}"),
        }
        found
    })
}

/// Finds the delegated cgroup early, before this process has children
/// (which would share its cgroup). Does nothing for root or on v1.
pub fn prepare() {
    if !nix::unistd::geteuid().is_root() && CgroupSupport::probe() == CgroupSupport::V2 {
        let _ = delegated_v2();
    }
}

/// The path in `/proc/self/cgroup`'s text of the v2 hierarchy (`0::/…`).
fn own_v2_cgroup(text: &str) -> Option<String> {
    text.lines().find_map(|l| l.strip_prefix("0::")).map(|p| p.trim().to_owned())
}

/// [`delegated_v2`] for a process `pid` of user `uid` in the cgroup `own`
/// (as `/proc/self/cgroup` names it) of the hierarchy at `root`.
fn resolve_v2(root: &Path, own: &str, uid: u32, pid: u32) -> Result<PathBuf, String> {
    use std::os::unix::fs::MetadataExt;
    let own_dir = root.join(own.trim_start_matches('/'));
    let setup = parent_in(root, uid);
    let how = "start moat in a cgroup of its own delegated to this user: `systemd-run --user --scope -p \
               Delegate=yes moat-mcp …` under systemd (docs/operations.md, \"Rootless\"), or as root, `moat setup \
               --user NAME` and start NAME's moat below the cgroup it delegates";
    if own_dir.starts_with(&setup) && own_dir != setup {
        return Ok(setup);
    }
    let owned = std::fs::metadata(&own_dir).is_ok_and(|m| m.uid() == uid)
        && nix::unistd::access(&own_dir.join("cgroup.procs"), nix::unistd::AccessFlags::W_OK).is_ok()
        && nix::unistd::access(&own_dir.join("cgroup.subtree_control"), nix::unistd::AccessFlags::W_OK).is_ok();
    if !owned {
        return Err(format!("this user cannot make cgroups where moat runs ({}, not delegated to it); {how}", own));
    }
    let leaf = own_dir.join(SERVER_LEAF);
    let others: Vec<String> = std::fs::read_to_string(own_dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter(|p| p.trim() != pid.to_string())
        .map(str::to_owned)
        .collect();
    if !others.is_empty() {
        return Err(format!(
            "moat runs in the cgroup {own}, delegated to this user, beside other processes ({}): a cgroup that \
             holds processes cannot give its children limits; {how}",
            others.join(", ")
        ));
    }
    let fail = |what: &str, e: std::io::Error| format!("{what} in the delegated cgroup {own} failed ({e}); {how}");
    match std::fs::create_dir(&leaf) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(fail("making the leaf moat", e)),
        _ => {}
    }
    std::fs::write(leaf.join("cgroup.procs"), pid.to_string()).map_err(|e| fail("moving moat into its leaf", e))?;
    let offered = std::fs::read_to_string(own_dir.join("cgroup.controllers")).unwrap_or_default();
    let offered: Vec<&str> = offered.split_whitespace().collect();
    let missing: Vec<&str> = ["memory", "pids"].into_iter().filter(|c| !offered.contains(c)).collect();
    if !missing.is_empty() {
        return Err(format!(
            "the cgroup {own} is delegated without the {} controller: sandboxes' limits need memory and pids; \
             delegate them (systemd: `-p Delegate=yes` delegates every controller; for user@.service, \
             `Delegate=pids memory cpu`)",
            missing.join(" and ")
        ));
    }
    enable_controllers(&own_dir, offered.contains(&"cpu"))
        .map_err(|e| fail("enabling the memory and pids controllers", e))?;
    Ok(own_dir)
}

/// Enables for the children of `dir` the controllers sandboxes' limits
/// need: memory and pids, or an error; then, with `cpu`, the cpu
/// controller in a write of its own, whose failure is let be. The kernel
/// takes or refuses one write whole, and the cpu controller can be
/// refused where the others are not (a real-time thread in the subtree):
/// a sandbox without its CPU share is still bounded in memory and
/// processes.
fn enable_controllers(dir: &Path, cpu: bool) -> std::io::Result<()> {
    use std::io::Write;
    let mut control = std::fs::OpenOptions::new().append(true).open(dir.join("cgroup.subtree_control"))?;
    control.write_all(b"+memory +pids\n")?;
    if cpu && let Err(e) = control.write_all(b"+cpu\n") {
        tracing::info!(dir = %dir.display(), "sandboxes get no CPU share here: the cpu controller was refused ({e})");
    }
    Ok(())
}

fn parent_in(hierarchy: &Path, uid: u32) -> PathBuf {
    let moat = hierarchy.join("moat");
    if uid == 0 { moat } else { moat.join(format!("user-{uid}")) }
}

/// Every directory sandbox `id` may have, one per hierarchy.
fn sandbox_dirs(id: &str) -> Vec<PathBuf> {
    let mut dirs = vec![parent(Path::new(ROOT)).join(id)];
    dirs.extend(V1_CONTROLLERS.iter().map(|c| parent(&Path::new(ROOT).join(c)).join(id)));
    dirs
}

/// What [`delegate`] did in one hierarchy, for `moat setup` to print.
#[derive(Debug)]
pub struct Delegated {
    pub dir: PathBuf,
    pub made: bool,
}

/// As root: gives user `uid` (group `gid`) a cgroup subtree of its own in
/// every hierarchy this host offers, `moat/user-<uid>/`, where it makes
/// its sandboxes' cgroups. The user owns the directory (to make cgroups
/// in) and not its limit files, which root may set to cap all of the
/// user's sandboxes together. On cgroup v2 the controllers are enabled
/// down to it.
pub fn delegate(support: &CgroupSupport, uid: u32, gid: u32) -> std::io::Result<Vec<Delegated>> {
    let hierarchies: Vec<PathBuf> = match support {
        CgroupSupport::None => return Err(std::io::Error::other("this host has no cgroups")),
        CgroupSupport::V2 => vec![Path::new(ROOT).to_path_buf()],
        CgroupSupport::V1 { controllers } => controllers.iter().map(|c| Path::new(ROOT).join(c)).collect(),
    };
    let mut done = Vec::new();
    for hierarchy in hierarchies {
        let dir = parent_in(&hierarchy, uid);
        let made = !dir.is_dir();
        std::fs::create_dir_all(&dir)
            .map_err(|e| std::io::Error::new(e.kind(), format!("making {}: {e}", dir.display())))?;
        let mut owned = vec![dir.clone()];
        if matches!(support, CgroupSupport::V2) {
            for level in [hierarchy.as_path(), &hierarchy.join("moat"), &dir] {
                enable_controllers(level, true).map_err(|e| {
                    std::io::Error::new(e.kind(), format!("enabling memory and pids in {}: {e}", level.display()))
                })?;
            }
            owned.extend(["cgroup.procs", "cgroup.subtree_control", "cgroup.threads"].map(|f| dir.join(f)));
        }
        for path in owned {
            nix::unistd::chown(&path, Some(uid.into()), Some(gid.into()))
                .map_err(|e| std::io::Error::other(format!("giving {} to uid {uid}: {e}", path.display())))?;
        }
        done.push(Delegated { dir, made });
    }
    Ok(done)
}

/// How recently a sandbox's cgroups may have been made and still be on
/// their way to holding its monitor: a moat of another data directory
/// makes them a moment before its monitor joins, within its start guard.
const STARTING: Duration = Duration::from_secs(60);

/// Removes the cgroups of sandbox `id` if no process is left in them
/// (another data directory's live sandbox is never touched, nor one it is
/// starting: cgroups made in the last [`STARTING`] are left).
pub fn remove_if_empty(id: &str, sweeper: Option<&Sweeper>) {
    let dirs = sandbox_dirs(id);
    // A live sandbox has its monitor and agent in `agent` (or, not split,
    // at the top): one read each tells, before any walk of its tree. Every
    // `moat` start sweeps, and other data directories' sandboxes are many.
    if dirs.iter().any(|d| count_procs(&d.join("agent")) > 0 || count_procs(d) > 0) {
        return;
    }
    let dirs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).filter(|d| d.exists()).collect();
    // A directory's time is when it, or its last child, was made.
    let lately = |d: &&Path| {
        std::fs::metadata(d).and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().map_or(true, |age| age < STARTING))
    };
    if dirs.iter().any(lately) {
        return;
    }
    if dirs.iter().all(|d| matches!(cgroupfs::processes(d), Ok(0))) {
        remove_trees(&dirs, sweeper);
    }
}

fn count_procs(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("cgroup.procs")).map_or(0, |procs| procs.lines().count())
}

/// Ids of every sandbox cgroup on this host.
pub fn sandbox_ids() -> Vec<String> {
    let mut parents = vec![parent(Path::new(ROOT))];
    parents.extend(V1_CONTROLLERS.iter().map(|c| parent(&Path::new(ROOT).join(c))));
    let mut ids: Vec<String> = parents
        .iter()
        .filter_map(|p| std::fs::read_dir(p).ok())
        .flatten()
        .filter_map(Result::ok)
        // The entry's own type: no stat of each.
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("sbx-"))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn write(dir: &Path, file: &str, value: &str) -> std::io::Result<()> {
    std::fs::write(dir.join(file), value).map_err(|e| {
        std::io::Error::new(e.kind(), format!("writing {value:?} to the sandbox's cgroup file {file}: {e}"))
    })
}

/// How long removing a sandbox's cgroups may wait for what is left in them
/// to die. SIGKILLed processes end in microseconds; a loaded machine may
/// take longer.
const REMOVE_GUARD: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    /// The sweep leaves a sandbox's empty cgroups made in the last minute:
    /// another moat (another data directory) makes them a moment before
    /// its monitor joins. Older empty ones, a crash's, go.
    #[test]
    fn empty_cgroups_being_started_elsewhere_are_left_and_old_ones_go() {
        let hierarchy = Path::new(ROOT).join("pids");
        let parent = parent(&hierarchy);
        let id = format!("sbx-sweeptest{}", std::process::id());
        let dir = parent.join(&id);
        if !hierarchy.join("cgroup.procs").exists() || std::fs::create_dir_all(&dir).is_err() {
            eprintln!("skipped: this host lets the test make no cgroup (run as root on a cgroup v1 host)");
            return;
        }
        remove_if_empty(&id, None);
        let young = dir.exists();
        // Made two minutes ago, as a crash's would be.
        let old = nix::sys::time::TimeSpec::from_duration(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970")
                - Duration::from_secs(120),
        );
        let dated = nix::sys::stat::utimensat(
            nix::fcntl::AT_FDCWD,
            &dir,
            &old,
            &old,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        );
        if dated.is_ok() {
            remove_if_empty(&id, None);
        }
        let gone = !dir.exists();
        let _ = std::fs::remove_dir(&dir);
        assert!(young, "a sandbox's cgroup made a moment ago was removed");
        assert!(dated.is_err() || gone, "an old empty cgroup was left");
    }

    #[test]
    fn a_sandbox_cgroup_that_exists_is_anothers() {
        let scratch = tempfile::tempdir().expect("tempdir");
        let dir = scratch.path().join("sbx-1");
        create_own(&dir).expect("new");
        let err = create_own(&dir).expect_err("there already");
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        assert!(err.to_string().contains("another sandbox's cgroup"), "{err}");
    }

    /// A cgroup that still holds a process is removed all the same: the
    /// process is killed and waited for, with no sleeping in between.
    #[test]
    fn a_cgroup_with_a_process_left_is_emptied_and_removed() {
        let hierarchy = match CgroupSupport::probe() {
            CgroupSupport::V2 => Path::new(ROOT).to_path_buf(),
            CgroupSupport::V1 { controllers } if controllers.contains(&"pids") => Path::new(ROOT).join("pids"),
            _ => return eprintln!("skipping: no cgroup hierarchy to test in"),
        };
        let dir = hierarchy.join("moat").join(format!("test-remove-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir_all(dir.join("child")) {
            return eprintln!("skipping: cannot make a cgroup ({e}); needs root");
        }
        let mut sleeper = std::process::Command::new("sleep").arg("30").spawn().expect("spawns sleep");
        std::fs::write(dir.join("child/cgroup.procs"), sleeper.id().to_string()).expect("moves sleep into the cgroup");
        remove_trees(&[&dir], None);
        assert!(!dir.exists(), "the cgroup is removed");
        assert!(sleeper.wait().expect("reaps sleep").code().is_none(), "sleep was killed");
    }

    /// A cgroup v2 hierarchy in a temporary directory: `own` holding
    /// `procs`, offering `controllers`.
    fn fake_v2(own: &str, procs: &str, controllers: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join(own.trim_start_matches('/'));
        std::fs::create_dir_all(&dir).expect("mkdir");
        for (file, text) in
            [("cgroup.procs", procs), ("cgroup.controllers", controllers), ("cgroup.subtree_control", "")]
        {
            std::fs::write(dir.join(file), text).expect("write");
        }
        root
    }

    #[test]
    fn own_cgroup_is_read_from_proc_self_cgroup() {
        assert_eq!(own_v2_cgroup("0::/user.slice/run-1.scope\n").as_deref(), Some("/user.slice/run-1.scope"));
        assert_eq!(own_v2_cgroup("4:memory:/x\n"), None);
    }

    /// A cgroup of its own (`systemd-run --user --scope -p Delegate=yes`):
    /// moat moves into its leaf and enables the controllers beside it.
    #[test]
    fn a_delegated_cgroup_of_its_own_takes_the_sandboxes_beside_moat() {
        let me = nix::unistd::geteuid().as_raw();
        let own = "/user.slice/user-1001.slice/user@1001.service/app.slice/run-r1.scope";
        let root = fake_v2(own, "4242\n", "cpuset cpu io memory pids\n");
        let dir = resolve_v2(root.path(), own, me, 4242).expect("delegated");
        assert_eq!(dir, root.path().join(own.trim_start_matches('/')));
        assert_eq!(std::fs::read_to_string(dir.join("moat/cgroup.procs")).expect("leaf").trim(), "4242");
        assert_eq!(
            std::fs::read_to_string(dir.join("cgroup.subtree_control")).expect("control"),
            "+memory +pids\n+cpu\n",
            "memory and pids in one write, cpu (which may be refused alone) in another"
        );
        let no_cpu = fake_v2(own, "4242\n", "memory pids\n");
        let dir = resolve_v2(no_cpu.path(), own, me, 4242).expect("delegated without cpu");
        assert_eq!(std::fs::read_to_string(dir.join("cgroup.subtree_control")).expect("control"), "+memory +pids\n");
    }

    #[test]
    fn a_shared_or_foreign_or_partial_cgroup_is_refused_with_how_to_start_moat() {
        let me = nix::unistd::geteuid().as_raw();
        let own = "/user.slice/user-1001.slice/session-3.scope";
        let shared = fake_v2(own, "4242\n77\n", "memory pids\n");
        let err = resolve_v2(shared.path(), own, me, 4242).expect_err("shared");
        assert!(err.contains("beside other processes (77)") && err.contains("systemd-run --user --scope"), "{err}");

        let foreign = fake_v2(own, "4242\n", "memory pids\n");
        let err = resolve_v2(foreign.path(), own, me + 1, 4242).expect_err("not the user's");
        assert!(err.contains("not delegated to it") && err.contains("moat setup --user"), "{err}");

        let partial = fake_v2(own, "4242\n", "cpu pids\n");
        let err = resolve_v2(partial.path(), own, me, 4242).expect_err("no memory controller");
        assert!(err.contains("without the memory controller"), "{err}");
    }

    /// Below what `moat setup --user` delegated: the sandboxes go there,
    /// and nothing moves.
    #[test]
    fn below_the_setup_delegation_the_sandboxes_go_in_it() {
        let own = "/moat/user-1001/session";
        let root = fake_v2(own, "4242\n", "memory pids\n");
        let dir = resolve_v2(root.path(), own, 1001, 4242).expect("delegated by setup");
        assert_eq!(dir, root.path().join("moat/user-1001"));
        assert!(!root.path().join("moat/user-1001/session/moat").exists(), "moat stays where it was started");
    }

    const LIMITS: Limits = Limits { memory_bytes: 3072 << 20, pids: 1024, cpus: 2 };

    fn value(settings: &[Setting], child: &str, file: &str) -> Option<String> {
        settings.iter().find(|s| s.child == child && s.file == file).map(|s| s.value.clone())
    }

    #[test]
    fn commands_get_the_sandbox_limits_less_the_agents_reserve() {
        let memory = v1_settings("memory", LIMITS);
        assert_eq!(value(&memory, "", "memory.limit_in_bytes"), Some((3072u64 << 20).to_string()));
        assert_eq!(value(&memory, "user", "memory.limit_in_bytes"), Some((3008u64 << 20).to_string()));
        let pids = v1_settings("pids", LIMITS);
        assert_eq!(value(&pids, "", "pids.max").as_deref(), Some("1024"));
        assert_eq!(value(&pids, "user", "pids.max").as_deref(), Some("960"));
        assert!(
            memory.iter().chain(&pids).filter(|s| !s.file.contains("memsw")).all(|s| s.required),
            "a limit that cannot be set refuses the sandbox"
        );
        // Swap counts too, where the kernel accounts it, each after the
        // RAM limit it may not be below.
        for child in ["", "user"] {
            let at = |file| memory.iter().position(|s| s.child == child && s.file == file).expect(file);
            assert!(at("memory.limit_in_bytes") < at("memory.memsw.limit_in_bytes"));
            assert_eq!(
                value(&memory, child, "memory.memsw.limit_in_bytes"),
                value(&memory, child, "memory.limit_in_bytes")
            );
        }
    }

    #[test]
    fn the_commands_and_the_agent_each_have_the_sandbox_cpu_quota_and_the_agent_outweighs_them() {
        let cpu = v1_settings("cpu", LIMITS);
        assert_eq!(value(&cpu, "", "cpu.cfs_quota_us"), None, "a quota shared with the commands throttles the agent");
        assert_eq!(value(&cpu, "user", "cpu.cfs_quota_us").as_deref(), Some("200000"));
        assert_eq!(value(&cpu, "agent", "cpu.cfs_quota_us").as_deref(), Some("200000"));
        assert_eq!(value(&cpu, "agent", "cpu.shares").as_deref(), Some("4096"));
        assert_eq!(value(&cpu, "user", "cpu.shares"), None, "the commands keep the kernel's default, 1024");
        // The commands leave the agent's CPU cgroup only if the agent gets
        // the CPU hierarchy's `user` to put them in.
        assert!(USER_CONTROLLERS.contains(&"cpu"));
        assert!(v1_settings("freezer", LIMITS).is_empty());
    }
}
