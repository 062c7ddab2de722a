//! A jail's keeper, on hosts whose freezer is cgroup v1: the process that
//! thaws the sandbox on its way down.
//!
//! A process frozen by cgroup v1's freezer takes no signal, not even
//! SIGKILL, until it is thawed. Two things freeze a sandbox's processes:
//! moat suspending an idle sandbox (its whole cgroup, the monitor and the
//! agent with it) and the agent freezing a command's cgroup for the
//! milliseconds of a kill. Whoever ends the sandbox must thaw them first,
//! or they outlive it, in state D, on the host. The host does so when it
//! destroys a sandbox, but it cannot when it is itself gone (its owner
//! SIGKILLed: the monitor's parent-death signal then waits, frozen, with
//! everything else), nor, when it runs as an unprivileged user, where the
//! command's cgroup belongs to the sandbox's root, one of the user's
//! subordinate ids.
//!
//! The keeper is forked by the monitor before it joins the sandbox's
//! cgroups (so no freeze of the sandbox reaches it) and after it entered
//! its own user namespace when rootless (so it holds the rights over the
//! subordinate ids' files that the monitor holds). It waits, by events
//! only, for the owner or the monitor to end or for the monitor's word
//! that the sandbox is being stopped, then thaws every freezer cgroup of
//! the sandbox, shallowest first, until the monitor is gone.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::pidfd::Pidfd;

/// How often a keeper that is thawing looks again while the monitor lives:
/// a freeze the agent had under way when it was killed may land after a
/// pass. A bound on waiting for the monitor's end, which is the event.
const THAW_AGAIN_MS: libc::c_int = 1000;

/// The sandbox's freezer cgroup among the `cgroup.procs` files the monitor
/// joins: `<dir>` of `<dir>/agent/cgroup.procs`, where `<dir>` has a
/// `freezer.state` (cgroup v1's freezer hierarchy; v2's frozen processes
/// die of SIGKILL and need no keeper).
pub fn freezer_dir(procs: &[PathBuf]) -> Option<PathBuf> {
    procs.iter().find_map(|p| {
        let dir = p.parent()?.parent()?;
        dir.join("freezer.state").exists().then(|| dir.to_path_buf())
    })
}

/// The monitor's side: a descriptor to wake the keeper through.
#[derive(Debug)]
pub struct Keeper {
    wake: OwnedFd,
}

impl Keeper {
    /// Forks the keeper of the sandbox whose freezer cgroup is `dir`, for
    /// the owner `owner`. Must be called while the process is
    /// single-threaded, before it joins the sandbox's cgroups.
    pub fn start(dir: PathBuf, owner: Pidfd) -> std::io::Result<Self> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let monitor = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
        let monitor_fd = Pidfd::of_pid(monitor)?;
        // SAFETY: the caller's contract: this process is single-threaded,
        // so the child holds no lock another thread owned; it only polls,
        // walks `dir` and exits.
        match unsafe { nix::unistd::fork() }? {
            nix::unistd::ForkResult::Child => {
                drop(write);
                keep(&dir, &owner, &monitor_fd, &read);
                // SAFETY: _exit(2) ends this process without running the
                // monitor's exit handlers or destructors twice.
                unsafe { libc::_exit(0) }
            }
            nix::unistd::ForkResult::Parent { .. } => Ok(Self { wake: write }),
        }
    }

    /// The descriptor a signal handler writes a byte to, to have the keeper
    /// thaw now (the sandbox is being stopped).
    pub fn wake_fd(&self) -> i32 {
        self.wake.as_raw_fd()
    }
}

/// The keeper's life: see the module's comment.
fn keep(dir: &Path, owner: &Pidfd, monitor: &Pidfd, wake: &OwnedFd) {
    let _ = nix::sys::prctl::set_name(c"moat-keeper");
    // Nothing of the monitor's standard input and output is the keeper's
    // (the host reads the monitor's readiness there).
    if let Ok(null) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null") {
        for fd in [0, 1] {
            // SAFETY: dup2(2) on a descriptor this function owns onto a
            // standard one; nothing else in this process uses them.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
    // Until the owner or the monitor ends, or the monitor says it stops.
    let watched = [owner.as_raw_fd(), monitor.as_raw_fd(), wake.as_raw_fd()];
    while poll(&watched, -1) == Some(false) {}
    loop {
        thaw_tree(dir);
        if poll(&[monitor.as_raw_fd()], THAW_AGAIN_MS) != Some(false) {
            // The monitor is gone (its init and pid namespace before it):
            // a last pass for what the namespace's end left frozen.
            thaw_tree(dir);
            return;
        }
    }
}

/// Waits up to `ms` (-1: no bound) for one of `fds` to read ready (a pidfd:
/// its process ended; a pipe: a byte or its end). `Some(true)` when one
/// did, `Some(false)` at the timeout or a signal, `None` when poll failed.
fn poll(fds: &[i32], ms: libc::c_int) -> Option<bool> {
    let mut polled: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    let count = libc::nfds_t::try_from(polled.len()).unwrap_or(libc::nfds_t::MAX);
    // SAFETY: `polled` holds `count` pollfds and lives across the call.
    match unsafe { libc::poll(polled.as_mut_ptr(), count, ms) } {
        1.. => Some(true),
        0 => Some(false),
        _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => Some(false),
        _ => None,
    }
}

/// Thaws the freezer cgroup `dir` and every cgroup beneath it, at any
/// depth, the shallowest first ([`moat_sys::cgroupfs::thaw`]). Nothing is
/// refused to the keeper: it holds the monitor's rights.
fn thaw_tree(dir: &Path) {
    let _ = moat_sys::cgroupfs::thaw(dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_freezer_cgroup_is_found_among_the_joined_ones() {
        let root = tempfile::tempdir().expect("tempdir");
        let freezer = root.path().join("freezer/moat/sbx-1");
        let pids = root.path().join("pids/moat/sbx-1");
        for dir in [&freezer, &pids] {
            std::fs::create_dir_all(dir.join("agent")).expect("mkdir");
        }
        std::fs::write(freezer.join("freezer.state"), "THAWED\n").expect("write");
        let procs = [pids.join("agent/cgroup.procs"), freezer.join("agent/cgroup.procs")];
        assert_eq!(freezer_dir(&procs), Some(freezer.clone()));
        assert_eq!(freezer_dir(&procs[..1]), None, "no keeper without a v1 freezer");
    }

    #[test]
    fn every_frozen_cgroup_beneath_is_thawed() {
        let root = tempfile::tempdir().expect("tempdir");
        let top = root.path().join("sbx-1");
        let deep = top.join("user/exec-3");
        std::fs::create_dir_all(&deep).expect("mkdir");
        std::fs::create_dir_all(top.join("agent")).expect("mkdir");
        for (dir, state) in
            [(&top, "FROZEN"), (&top.join("agent"), "THAWED"), (&top.join("user"), "FREEZING"), (&deep, "FROZEN")]
        {
            std::fs::write(dir.join("freezer.state"), format!("{state}\n")).expect("write");
        }
        thaw_tree(&top);
        for dir in [&top, &top.join("agent"), &top.join("user"), &deep] {
            assert_eq!(std::fs::read_to_string(dir.join("freezer.state")).expect("read").trim(), "THAWED");
        }
    }
}
