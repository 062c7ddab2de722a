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

pub use moat_sys::fds::keep_inherited_descriptors_to_this_process;

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
