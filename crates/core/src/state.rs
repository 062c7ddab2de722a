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
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

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
    // Before anything is made in them.
    for level in dir.ancestors().filter(|d| !d.as_os_str().is_empty()) {
        let meta = match std::fs::metadata(level) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            other => other?,
        };
        if let Some(why) = unsafe_owner(meta.uid(), meta.mode(), me) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "{} {why}: another user could plant state moat trusts there; use a data directory of your \
                     own (MOAT_DATA_DIR, or the default under your home)",
                    level.display()
                ),
            ));
        }
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let meta = std::fs::metadata(dir)?;
    if meta.mode() & 0o077 != 0 && meta.uid() == me {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Why a directory owned by `uid` with `mode` is not safe to keep user
/// `me`'s state in or beneath: `None` when it is (the user's or root's,
/// and not writable by everyone unless sticky, as `/tmp` is).
fn unsafe_owner(uid: u32, mode: u32, me: u32) -> Option<String> {
    if uid != me && uid != 0 {
        return Some(format!("belongs to uid {uid}"));
    }
    (mode & 0o002 != 0 && mode & 0o1000 == 0).then(|| format!("is writable by every user (mode {:o})", mode & 0o7777))
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
        if let Some(monitor) = live_monitor(&dir) {
            let _ = kill(Pid::from_raw(monitor), Signal::SIGKILL);
        }
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
        // A real tree: another user's directory above is refused, by name.
        let scratch = tempfile::tempdir().expect("tempdir");
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
