//! Waiting for a child process to end by event rather than by polling: a
//! pidfd (`pidfd_open(2)`, Linux 5.3) becomes readable when its process
//! exits, which both `poll(2)` and tokio's reactor can wait on.
//!
//! The pidfd itself is [`moat_sys::pidfd`]'s, shared with the agent; this
//! adds the wait on tokio's reactor. (std's `PidFd` is still unstable.)

use std::io;

pub use moat_sys::pidfd::{Pidfd, wait_all};

/// A pidfd's end awaited on tokio's reactor.
pub trait Exited {
    /// Resolves when the process has ended (needs a tokio runtime).
    fn exited(self) -> impl std::future::Future<Output = io::Result<()>> + Send;
}

impl Exited for Pidfd {
    async fn exited(self) -> io::Result<()> {
        // SAFETY: the AsyncFd owns the OwnedFd, whose descriptor stays open
        // and the same until the AsyncFd drops it.
        let fd =
            unsafe { tokio::io::unix::AsyncFd::register_with_interest(self.into_fd(), tokio::io::Interest::READABLE) }
                .map_err(|e| e.into_parts().1)?;
        let _ready = fd.readable().await?;
        Ok(())
    }
}

/// Marks every descriptor this process inherited beyond stdio
/// close-on-exec, so that none reaches a program it starts (the jail's
/// monitor, and through it the sandbox; moat-vmm; pasta, passt, git): what
/// moat's own parent left open without the flag (a supervisor's socket, a
/// shell's redirection, an editor's pipe) is the parent's business, never
/// a sandbox's. Called first thing by each binary, while it has no thread.
pub fn keep_inherited_descriptors_to_this_process() {
    // SAFETY: close_range(2) with CLOSE_RANGE_CLOEXEC changes only the
    // flags of this process's descriptors, closing none.
    let done = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) };
    if done != 0 {
        // Linux before 5.11: no flag. Each open descriptor then, one by one.
        if let Ok(entries) = std::fs::read_dir("/proc/self/fd") {
            let fds: Vec<i32> =
                entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).filter(|fd| *fd > 2).collect();
            for fd in fds {
                // SAFETY: fcntl(F_SETFD) on a descriptor number; one that is
                // not open (the listing's own, gone by now) fails harmlessly.
                unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            }
        }
    }
}

/// The variables a helper moat starts on the host (the jail's monitor and
/// its cgroup sweeper, moat-vmm, passt; pasta through the monitor) is
/// given, when set: the rest of moat's environment is not. It may hold
/// secrets (`MOAT_HTTP_TOKEN`, whatever keys the MCP host passes its
/// servers), and these helpers parse what sandboxes send: one taken over
/// would find nothing of them in its memory or its `/proc/PID/environ`.
pub const HELPER_ENV: &[&str] = &["PATH", "LANG", "LC_ALL", "TZ", "RUST_BACKTRACE"];

/// [`HELPER_ENV`]'s variables of this process, for `env_clear().envs(…)`.
pub fn helper_env() -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    HELPER_ENV.iter().filter_map(|var| Some(((*var).into(), std::env::var_os(var)?))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pidfd_is_awaited_on_the_reactor() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawns sleep");
        let pidfd = Pidfd::of(&child).expect("pidfd_open");
        let waiter = tokio::spawn(pidfd.try_clone().expect("dup").exited());
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        child.kill().expect("kills");
        waiter.await.expect("joins").expect("waits");
        assert!(pidfd.has_exited());
        child.wait().expect("reaps");
    }
}
