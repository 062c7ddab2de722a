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
        std::fs::create_dir_all(&path)?;
        let file = File::create(path.join("lock"))?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| std::io::Error::from(e))?;
        std::fs::write(path.join("owner"), std::process::id().to_string())?;
        Ok(Self { path, _lock: lock })
    }

    /// Records the pid of the sandbox's monitor process.
    pub fn record_monitor(&self, pid: u32) -> std::io::Result<()> {
        std::fs::write(self.path.join("monitor"), pid.to_string())
    }

    /// Removes the directory (the lock goes with the value).
    pub fn remove(self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!(path = %self.path.display(), "cannot remove a sandbox state directory: {e}");
        }
    }
}

/// Removes every sandbox whose owner is dead: kills its monitor (and so its
/// processes), removes its cgroups and its directory. Returns the ids swept.
pub fn sweep(data_dir: &Path) -> Vec<String> {
    let mut swept = Vec::new();
    // Empty cgroups whose sandbox has no state directory here (a crash
    // between the two removals). Cgroups with processes may belong to a
    // moat using another data directory: those are left alone.
    for id in crate::cgroup::sandbox_ids() {
        if !sandboxes_dir(data_dir).join(&id).exists() {
            crate::cgroup::remove_if_empty(&id);
        }
    }
    let Ok(entries) = std::fs::read_dir(sandboxes_dir(data_dir)) else { return swept };
    for entry in entries.filter_map(Result::ok) {
        let dir = entry.path();
        let id = entry.file_name().to_string_lossy().into_owned();
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
        if let Some(monitor) = read_pid(&dir.join("monitor"))
            && is_monitor_of(monitor, &dir)
        {
            let _ = kill(Pid::from_raw(monitor), Signal::SIGKILL);
        }
        Cgroup::remove_leftovers(&id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => tracing::info!(%id, owner = owner.trim(), "removed a sandbox left by a dead owner"),
            Err(e) => tracing::warn!(%id, "cannot remove a dead owner's sandbox: {e}"),
        }
        swept.push(id);
    }
    swept
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether `pid` is still the monitor of the sandbox at `dir` (and not a
/// process that reused the pid).
fn is_monitor_of(pid: i32, dir: &Path) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|cmdline| {
            let text = String::from_utf8_lossy(&cmdline);
            (text.contains("jail") || text.contains("moat-vmm")) && text.contains(&*dir.to_string_lossy())
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_owners_are_kept_dead_ones_swept() {
        let data = tempfile::tempdir().expect("tempdir");
        let live = StateDir::create(data.path(), "sbx-live").expect("create");
        // A directory whose owner died: nobody holds its lock.
        let dead = sandboxes_dir(data.path()).join("sbx-dead");
        std::fs::create_dir_all(&dead).expect("mkdir");
        std::fs::write(dead.join("lock"), "").expect("lock file");
        std::fs::write(dead.join("owner"), "999999").expect("owner");
        assert_eq!(sweep(data.path()), ["sbx-dead"]);
        assert!(live.path.exists());
        assert!(!dead.exists());
        live.remove();
    }
}
