//! `moat-agent cgroup-sweep`: a rootless sandbox's cgroups removed with
//! the rights of the user's subordinate ids.
//!
//! In a rootless jail the command cgroups belong to the sandbox's root,
//! one of the user's subordinate ids (the agent makes them in `user`, see
//! [`crate::cgroup`]). Sandbox root may make cgroups beneath them, and
//! those the user can neither remove (`rmdir(2)` needs write access to the
//! parent, sandbox root's), nor thaw, nor empty (their processes are
//! subordinate ids'). Left there, they would keep the sandbox's cgroups
//! on the host after its end, where no later sweep could remove them.
//!
//! The host runs this program, as the user, when its own removal of a
//! sandbox's cgroups is refused. It enters the user's namespace, where
//! the subordinate ids are mapped (the monitor's, entered the same way:
//! [`crate::jail::enter_own_userns`]), so it holds over those cgroups the
//! rights their owners hold and nothing beyond the user's own ranges. There
//! it thaws, empties and removes each tree it is given, through directory
//! descriptors ([`moat_sys::cgroupfs`]), at any depth.
//!
//! It takes only what a host would give it: a sandbox's cgroup (`sbx-…`)
//! of a cgroup file system, beneath a `moat` directory (root's layout,
//! and `moat setup --user`'s) or beside one (a delegated cgroup, where
//! moat keeps itself in the leaf `moat` and its sandboxes' cgroups beside
//! it).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moat_sys::cgroupfs::{self, Busy};

/// How long emptying the trees may wait for their processes to die.
const GUARD: Duration = Duration::from_secs(10);

/// The ids to act as and the trees to remove.
#[derive(Debug)]
pub struct Sweep {
    pub id_base: u32,
    pub id_count: u32,
    pub rootless: crate::jail::Rootless,
    pub dirs: Vec<PathBuf>,
}

/// Whether `dir` is a sandbox's cgroup: absolute, named `sbx-…`, beneath
/// a `moat` directory or beside one, on a cgroup file system (v1 or v2).
pub fn check(dir: &Path) -> Result<(), String> {
    let beside_moat = dir.parent().is_some_and(|parent| parent.join("moat").is_dir());
    let named = dir.is_absolute()
        && dir.file_name().is_some_and(|n| n.to_string_lossy().starts_with("sbx-"))
        && (beside_moat || dir.components().any(|c| c.as_os_str() == "moat"));
    if !named {
        return Err(format!("{}: not a sandbox's cgroup (moat/…/sbx-…, or sbx-… beside a moat leaf)", dir.display()));
    }
    let kind = nix::sys::statfs::statfs(dir).map_err(|e| format!("{}: {e}", dir.display()))?.filesystem_type();
    if kind != nix::sys::statfs::CGROUP_SUPER_MAGIC && kind != nix::sys::statfs::CGROUP2_SUPER_MAGIC {
        return Err(format!("{}: not on a cgroup file system", dir.display()));
    }
    Ok(())
}

/// Checks every directory, enters the user's namespace and removes them.
/// Must be called while the process is single-threaded (it enters a user
/// namespace). The error says which tree is left and why.
pub fn run(sweep: &Sweep) -> Result<(), String> {
    // A directory that is gone already needs nothing.
    let dirs: Vec<&PathBuf> = sweep.dirs.iter().filter(|d| d.exists()).collect();
    for dir in &dirs {
        check(dir)?;
    }
    if dirs.is_empty() {
        return Ok(());
    }
    crate::jail::enter_own_userns(sweep.id_base, sweep.id_count, &sweep.rootless)
        .map_err(|e| format!("{e}: {}", std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default()))?;
    // Every tree thawed before any is emptied: a process frozen in one
    // hierarchy holds its cgroups in the others.
    for dir in &dirs {
        if let Err(e) = cgroupfs::thaw(dir) {
            eprintln!("moat-agent cgroup-sweep: {e}");
        }
    }
    let deadline = Instant::now() + GUARD;
    let left: Vec<String> = dirs
        .iter()
        .filter_map(|dir| cgroupfs::remove(dir, Busy::Kill, deadline).err())
        .map(|e| e.to_string())
        .collect();
    if left.is_empty() { Ok(()) } else { Err(left.join("; ")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_sandbox_cgroup_is_taken() {
        for bad in ["sbx-1", "/tmp/moat/sbx-1", "/sys/fs/cgroup/pids/moat/agent", "/sys/fs/cgroup/pids/sbx-1"] {
            assert!(check(Path::new(bad)).is_err(), "{bad}");
        }
        let scratch = tempfile::tempdir().expect("tempdir");
        let dir = scratch.path().join("moat/sbx-1");
        std::fs::create_dir_all(&dir).expect("mkdir");
        let why = check(&dir).expect_err("not a cgroup file system");
        assert!(why.contains("not on a cgroup file system"), "{why}");
        // A delegated cgroup (a systemd scope): moat in its leaf `moat`,
        // its sandboxes' cgroups beside it.
        let scope = scratch.path().join("user@1000.service/app.slice/run-1.scope");
        std::fs::create_dir_all(scope.join("moat")).expect("mkdir");
        std::fs::create_dir_all(scope.join("sbx-2")).expect("mkdir");
        let why = check(&scope.join("sbx-2")).expect_err("not a cgroup file system");
        assert!(why.contains("not on a cgroup file system"), "{why}");
        let why = check(&scratch.path().join("user@1000.service/app.slice/sbx-3")).expect_err("no moat leaf");
        assert!(why.contains("not a sandbox's cgroup"), "{why}");
    }
}
