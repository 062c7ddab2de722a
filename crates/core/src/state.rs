//! The state directory: one directory per live sandbox under
//! `<data>/sandboxes/<id>/`, locked by its owner, and the startup sweep that
//! removes what dead owners left behind.
//!
//! The lock is an `flock` held for the sandbox's whole life by the process
//! that created it. The kernel releases it when that process dies, however
//! it dies, so "the lock can be taken" means "the owner is gone".

use std::fs::File;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use crate::cgroup::Cgroup;

/// The directory holding every sandbox's state directory.
pub fn sandboxes_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("sandboxes")
}

/// A sandbox's state directory, locked for as long as this value lives.
#[derive(Debug)]
pub struct StateDir {
    pub path: PathBuf,
    _lock: Flock<File>,
}

impl StateDir {
    /// Creates and locks `<data>/sandboxes/<id>/`, recording the owner's pid.
    pub fn create(data_dir: &Path, id: &str) -> std::io::Result<Self> {
        let path = sandboxes_dir(data_dir).join(id);
        // Until its lock is held, the directory looks like a dead owner's to
        // a sweep: this process's own sweep (which runs beside its first
        // creates) passes it by.
        let _creating = Creating::mark(&path);
        private_dir(&sandboxes_dir(data_dir))?;
        std::fs::create_dir_all(&path)?;
        let file = File::create(path.join("lock"))?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| std::io::Error::from(e))?;
        std::fs::write(path.join("owner"), std::process::id().to_string())?;
        Ok(Self { path, _lock: lock })
    }

    /// Records the sandbox's monitor process: its pid and its start time
    /// (clock ticks after boot), which together name one process for the
    /// life of the host, so a sweep never kills one that reused the pid.
    pub fn record_monitor(&self, pid: u32) -> std::io::Result<()> {
        let pid = i32::try_from(pid).map_err(std::io::Error::other)?;
        let started = start_time(pid).ok_or_else(|| {
            std::io::Error::other(format!("the monitor (pid {pid}) exited before it could be recorded"))
        })?;
        std::fs::write(self.path.join("monitor"), format!("{pid} {started}"))
    }

    /// Removes the directory (the lock goes with the value).
    pub fn remove(self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!(path = %self.path.display(), "cannot remove a sandbox state directory: {e}");
        }
    }
}

/// Makes `dir` and its missing parents mode 0700, and closes `dir` to
/// others if it was open (made by an earlier moat, or under another
/// umask): a user's sandboxes and tasks are that user's alone. Refused
/// where `dir` or a directory above it is another user's, or open to
/// everyone's writes without the sticky bit: whoever could write there
/// could plant names moat trusts (a state directory its sweep kills and
/// removes the cgroups of, a link its files are written through).
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let me = nix::unistd::geteuid().as_raw();
    // Before anything is made in them (a directory there already, the
    // usual case on every sandbox's create, is judged once, below).
    if !std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
        trusted(dir)?;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    // Made, or there already: another user's directory put in its place
    // after the check above is not taken for this user's.
    trusted(dir)?;
    // The user's own, not merely a directory above it may be root's (a
    // shared `/tmp` itself named as the data directory, say).
    let meta = std::fs::metadata(dir)?;
    if meta.uid() != me {
        return Err(untrusted(dir, &format!("belongs to uid {}", meta.uid())));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Whether other local users can pass every directory down to `dir`, and
/// so reach what lies beneath it by name: then the directory to close with
/// `chmod 700`, the highest of the user's own on the way (their home, say;
/// for root, whose are all the system's, `dir` itself).
/// An image beneath must stay reachable by the ids of a rootless build's
/// and jail's user namespace, which are not the user, so moat does not
/// close its data directory itself: `moat doctor` says this.
pub fn open_to_others(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let me = nix::unistd::geteuid().as_raw();
    let dir = dir.canonicalize().ok()?;
    let mut highest_own = None;
    for level in dir.ancestors() {
        let meta = std::fs::metadata(level).ok()?;
        if meta.mode() & 0o001 == 0 {
            return None;
        }
        if meta.uid() == me {
            highest_own = Some(level.to_path_buf());
        }
    }
    if me == 0 { Some(dir) } else { highest_own }
}

/// Whether state kept in `dir` can be trusted: every directory on its path
/// (each link as itself, and again on the path it leads to) is this user's
/// or root's, and none is writable by everyone unless sticky. Checked
/// before a sweep or `moat ls`/`rm` acts on what is there (kills a
/// recorded monitor, removes cgroups and directories), and before state is
/// made there; a directory that does not exist yet passes.
pub fn trusted(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let me = nix::unistd::geteuid().as_raw();
    let resolved = dir.canonicalize().ok();
    let levels = dir.ancestors().map(|level| (level, false));
    let real = resolved.iter().flat_map(|d| d.ancestors()).map(|level| (level, true));
    for (level, follow) in levels.chain(real).filter(|(d, _)| !d.as_os_str().is_empty()) {
        let meta = match if follow { std::fs::metadata(level) } else { std::fs::symlink_metadata(level) } {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            other => other?,
        };
        if let Some(why) = unsafe_owner(meta.uid(), meta.mode(), me) {
            return Err(untrusted(level, &why));
        }
    }
    Ok(())
}

fn untrusted(level: &Path, why: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!(
            "{} {why}: another user could plant state moat trusts there; use a data directory of your own: set \
             MOAT_DATA_DIR, or leave it unset under your own home (as root, run sudo with -H, not -E)",
            level.display()
        ),
    )
}

/// Why a directory owned by `uid` with `mode` is not safe to keep user
/// `me`'s state in or beneath: `None` when it is (the user's or root's,
/// and not writable by everyone unless sticky, as `/tmp` is).
fn unsafe_owner(uid: u32, mode: u32, me: u32) -> Option<String> {
    if uid != me && uid != 0 {
        return Some(format!("belongs to uid {uid}"));
    }
    // A link's own mode is always 0777 and means nothing.
    let link = mode & libc::S_IFMT == libc::S_IFLNK;
    (!link && mode & 0o002 != 0 && mode & 0o1000 == 0)
        .then(|| format!("is writable by every user (mode {:o})", mode & 0o7777))
}

/// State directories this process is creating and has not locked yet.
static CREATING: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Marks a state directory as being created, for as long as it lives.
struct Creating(PathBuf);

impl Creating {
    fn mark(path: &Path) -> Self {
        creating().push(path.to_path_buf());
        Self(path.to_path_buf())
    }
}

impl Drop for Creating {
    fn drop(&mut self) {
        creating().retain(|p| *p != self.0);
    }
}

fn creating() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    // Each critical section is one push, retain or search: a panic leaves it whole.
    CREATING.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Removes every sandbox whose owner is dead: kills its monitor (and so its
/// processes), removes its cgroups and its directory. Returns the ids swept.
/// A directory this process is still creating is not a dead owner's.
pub fn sweep(data_dir: &Path, sweeper: Option<&crate::cgroup::Sweeper>) -> Vec<String> {
    let mut swept = Vec::new();
    // What another user could have planted is not acted on: a recorded
    // monitor would be killed, a named sandbox's cgroups removed.
    if let Err(e) = trusted(&sandboxes_dir(data_dir)) {
        tracing::warn!("no sweep of sandboxes left by dead owners: {e}");
        return swept;
    }
    // Empty cgroups whose sandbox has no state directory here (a crash
    // between the two removals). Cgroups with processes may belong to a
    // moat using another data directory: those are left alone.
    for id in crate::cgroup::sandbox_ids() {
        if !sandboxes_dir(data_dir).join(&id).exists() {
            crate::cgroup::remove_if_empty(&id, sweeper);
        }
    }
    let Ok(entries) = std::fs::read_dir(sandboxes_dir(data_dir)) else { return swept };
    for entry in entries.filter_map(Result::ok) {
        let dir = entry.path();
        let id = entry.file_name().to_string_lossy().into_owned();
        // Marked before its directory is made: a directory seen here and
        // not marked is not this process's.
        if creating().contains(&dir) {
            continue;
        }
        let lock = File::options().read(true).write(true).open(dir.join("lock"));
        let owner_alive = match lock {
            Ok(file) => Flock::lock(file, FlockArg::LockExclusiveNonblock).is_err(),
            // No lock file: a sandbox that died while being created.
            Err(_) => false,
        };
        if owner_alive {
            continue;
        }
        let owner = std::fs::read_to_string(dir.join("owner")).unwrap_or_default();
        kill_monitor(&dir);
        Cgroup::remove_leftovers(&id, sweeper);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => tracing::info!(%id, owner = owner.trim(), "removed a sandbox left by a dead owner"),
            Err(e) => tracing::warn!(%id, "cannot remove a dead owner's sandbox: {e}"),
        }
        swept.push(id);
    }
    swept
}

/// The monitor (or VMM) of the sandbox whose state directory is
/// `state_dir`, while that process lives: the same pid, started at the
/// same clock tick as recorded. A pid alone, or a look at its command
/// line, could name a process that reused it.
pub fn live_monitor(state_dir: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(state_dir.join("monitor")).ok()?;
    let (pid, started) = text.trim().split_once(' ')?;
    let (pid, started): (i32, u64) = (pid.parse().ok()?, started.parse().ok()?);
    // Not its owner's uid as well: a rootless monitor runs as an id of
    // the user's namespace, and a non-dumpable process's /proc entry is
    // root's. Pid and tick name one process.
    (pid > 1 && start_time(pid) == Some(started)).then_some(pid)
}

/// Kills the monitor (or VMM) of the sandbox whose state directory is
/// `state_dir`, if it lives: through a pidfd taken before its start time is
/// checked, so the signal reaches that process and never one that reused
/// its pid in between. Whether there was one to kill.
pub fn kill_monitor(state_dir: &Path) -> bool {
    let Some(pid) = live_monitor(state_dir) else { return false };
    let Ok(pidfd) = crate::process::Pidfd::of_pid(pid) else { return false };
    // The pidfd names whichever process had the pid when it was taken:
    // still the monitor only if its start time is still the recorded one.
    live_monitor(state_dir) == Some(pid) && pidfd.kill().is_ok()
}

/// When process `pid` started, in clock ticks after boot (field 22 of
/// `/proc/PID/stat`; the fields are counted after the command name, which
/// may hold spaces and parentheses).
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_monitor_is_that_process_only() {
        let scratch = tempfile::tempdir().expect("tempdir");
        let state = StateDir::create(scratch.path(), "sbx-test").expect("state dir");
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        state.record_monitor(child.id()).expect("record");
        let file = state.path.join("monitor");
        let pid = i32::try_from(child.id()).expect("pid");
        assert_eq!(live_monitor(&state.path), Some(pid));
        // Another start time is another process that has the pid now.
        let started = start_time(pid).expect("alive");
        std::fs::write(&file, format!("{pid} {}", started + 1)).expect("write");
        assert_eq!(live_monitor(&state.path), None);
        // A bare pid (an older record, or one planted) names nobody.
        std::fs::write(&file, pid.to_string()).expect("write");
        assert_eq!(live_monitor(&state.path), None);
        std::fs::write(&file, format!("{pid} {started}")).expect("write");
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert_eq!(live_monitor(&state.path), None, "a dead process is not a monitor");
        assert_eq!(start_time(1).map(|_| ()), Some(()), "init's stat parses");
    }

    #[test]
    fn state_is_kept_only_where_no_other_user_writes() {
        assert_eq!(unsafe_owner(1000, 0o40700, 1000), None);
        assert_eq!(unsafe_owner(0, 0o40755, 1000), None, "root's directories above are fine");
        assert_eq!(unsafe_owner(0, 0o41777, 1000), None, "a sticky /tmp is fine");
        assert_eq!(unsafe_owner(1000, 0o40775, 1000), None, "a user's private group may write");
        assert!(unsafe_owner(1001, 0o40700, 1000).expect("another user's").contains("uid 1001"));
        assert!(unsafe_owner(1001, 0o40755, 0).is_some(), "root keeps no state in a user's directory");
        assert!(unsafe_owner(0, 0o40777, 1000).expect("open").contains("mode 777"));
        // One's own directory, made or found open, is closed to others.
        let scratch = tempfile::tempdir().expect("tempdir");
        let open = scratch.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        for dir in [open, scratch.path().join("made/data")] {
            private_dir(&dir).expect("one's own");
            let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&dir).expect("stat").permissions());
            assert_eq!(mode & 0o777, 0o700, "{}", dir.display());
        }
        // A real tree: another user's directory above is refused, by name.
        let theirs = scratch.path().join("theirs");
        std::fs::create_dir(&theirs).expect("mkdir");
        if std::os::unix::fs::chown(&theirs, Some(4242), Some(4242)).is_err() {
            return eprintln!("skipping the tree: chown needs root");
        }
        let why = private_dir(&theirs.join("sandboxes")).expect_err("another user's directory is refused");
        assert!(why.to_string().contains("belongs to uid 4242") && why.to_string().contains("MOAT_DATA_DIR"), "{why}");
        assert!(!theirs.join("sandboxes").exists(), "nothing is made in another user's directory");
        private_dir(&scratch.path().join("mine/sandboxes")).expect("one's own is fine");
    }

    #[test]
    fn a_directory_others_can_pass_to_is_named() {
        let scratch = tempfile::tempdir().expect("tempdir");
        let data = scratch.path().join("home/data");
        std::fs::create_dir_all(&data).expect("mkdir");
        let mode = |path: &Path, mode: u32| {
            std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).expect("chmod");
        };
        let open_above = |path: &Path| {
            path.ancestors().skip(1).all(|level| {
                std::os::unix::fs::MetadataExt::mode(&std::fs::metadata(level).expect("stat")) & 0o001 != 0
            })
        };
        if !open_above(scratch.path()) {
            return eprintln!("skipping: a directory above the scratch directory is closed already");
        }
        mode(scratch.path(), 0o755);
        mode(&scratch.path().join("home"), 0o755);
        let to_close = if nix::unistd::geteuid().is_root() { data.clone() } else { scratch.path().to_path_buf() };
        assert_eq!(open_to_others(&data), Some(to_close.canonicalize().expect("real")));
        mode(&scratch.path().join("home"), 0o700);
        assert_eq!(open_to_others(&data), None, "the home closed");
    }

    #[test]
    fn live_owners_are_kept_dead_ones_swept() {
        let data = tempfile::tempdir().expect("tempdir");
        let live = StateDir::create(data.path(), "sbx-live").expect("create");
        // A directory whose owner died: nobody holds its lock.
        let dead = sandboxes_dir(data.path()).join("sbx-dead");
        std::fs::create_dir_all(&dead).expect("mkdir");
        std::fs::write(dead.join("lock"), "").expect("lock file");
        std::fs::write(dead.join("owner"), "999999").expect("owner");
        assert_eq!(sweep(data.path(), None), ["sbx-dead"]);
        assert!(live.path.exists());
        assert!(!dead.exists());
        live.remove();
    }

    /// A data directory another user could write in, or a link to one, is
    /// not swept: a "dead owner's" state planted there (a recorded monitor
    /// that is any process of the host) is left alone. A link of the user's
    /// own to a directory of theirs is fine.
    #[test]
    fn a_sweep_acts_on_nothing_another_user_could_have_planted() {
        let scratch = tempfile::tempdir().expect("tempdir");
        let plant = |data: &Path| {
            let dead = sandboxes_dir(data).join("sbx-planted");
            std::fs::create_dir_all(&dead).expect("mkdir");
            std::fs::write(dead.join("lock"), "").expect("lock file");
            dead
        };
        let mut victim = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let pid = i32::try_from(victim.id()).expect("pid");
        let record = |dead: &Path| {
            let started = start_time(pid).expect("alive");
            std::fs::write(dead.join("monitor"), format!("{pid} {started}")).expect("monitor");
        };
        let theirs = scratch.path().join("theirs");
        let dead = plant(&theirs);
        record(&dead);
        if std::os::unix::fs::chown(&theirs, Some(4242), Some(4242)).is_err() {
            victim.kill().expect("kill");
            victim.wait().expect("reaped");
            return eprintln!("skipping: chown needs root");
        }
        // Theirs, named directly or through a link of the user's own.
        let link = scratch.path().join("link");
        std::os::unix::fs::symlink(&theirs, &link).expect("symlink");
        for data in [&theirs, &link] {
            assert!(sweep(data, None).is_empty(), "{}", data.display());
            assert!(dead.exists() && live_monitor(&dead) == Some(pid), "the planted state was acted on");
            let why = trusted(&sandboxes_dir(data)).expect_err("untrusted");
            assert!(why.to_string().contains("belongs to uid 4242"), "{why}");
        }
        // The user's own `sandboxes` made a link (another user's) to the
        // planted directory: the link itself is judged.
        let mine = scratch.path().join("mine");
        std::fs::create_dir(&mine).expect("mkdir");
        std::os::unix::fs::symlink(theirs.join("sandboxes"), sandboxes_dir(&mine)).expect("symlink");
        nix::unistd::fchownat(
            nix::fcntl::AT_FDCWD,
            &sandboxes_dir(&mine),
            Some(4242.into()),
            Some(4242.into()),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .expect("lchown");
        assert!(sweep(&mine, None).is_empty());
        assert_eq!(live_monitor(&dead), Some(pid));
        // Given back to the user, the same state is swept, through a link
        // of the user's own as well: its monitor killed.
        std::os::unix::fs::chown(&theirs, Some(nix::unistd::geteuid().as_raw()), None).expect("chown");
        assert_eq!(sweep(&link, None), ["sbx-planted"]);
        assert!(!dead.exists());
        victim.wait().expect("killed by the sweep, as a dead owner's monitor");
    }

    /// The sweep runs beside this process's first creates: a directory made
    /// but not locked yet is theirs, not a dead owner's.
    #[test]
    fn a_directory_being_created_here_is_not_swept() {
        let data = tempfile::tempdir().expect("tempdir");
        let half_made = sandboxes_dir(data.path()).join("sbx-new");
        let marked = Creating::mark(&half_made);
        std::fs::create_dir_all(&half_made).expect("mkdir");
        assert!(sweep(data.path(), None).is_empty(), "no lock file yet, but it is being created");
        assert!(half_made.exists());
        drop(marked);
        assert_eq!(sweep(data.path(), None), ["sbx-new"], "unmarked and unlocked: a dead owner's");
    }
}
