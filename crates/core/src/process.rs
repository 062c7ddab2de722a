//! Waiting for a child process to end by event rather than by polling: a
//! pidfd (`pidfd_open(2)`, Linux 5.3) becomes readable when its process
//! exits, which both `poll(2)` and tokio's reactor can wait on.
//!
//! Hand-written: std's `PidFd` is still unstable, and the few lines here
//! are not worth a crate.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::process::Child;
use std::time::{Duration, Instant};

/// A pidfd of a child process.
#[derive(Debug)]
pub struct Pidfd(OwnedFd);

impl Pidfd {
    /// A pidfd of `child`, which must not be reaped yet (its pid then still
    /// names it: no race with a recycled pid).
    pub fn of(child: &Child) -> io::Result<Self> {
        let pid = libc::pid_t::try_from(child.id()).map_err(|_| io::Error::other("pid out of range"))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new
        // descriptor or -1; no memory is shared.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = i32::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
        // SAFETY: the kernel just returned this descriptor; nothing else owns it.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Another descriptor of the same process, for a second waiter.
    pub fn try_clone(&self) -> io::Result<Self> {
        self.0.try_clone().map(Self)
    }

    /// Whether the process has ended, without waiting.
    pub fn has_exited(&self) -> bool {
        self.wait_timeout(Duration::ZERO)
    }

    /// Blocks until the process has ended or `timeout` has passed; true
    /// when it has ended.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pollfd = libc::pollfd { fd: self.0.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            let ms =
                libc::c_int::try_from(left.as_millis().max(u128::from(!left.is_zero()))).unwrap_or(libc::c_int::MAX);
            // SAFETY: one pollfd that lives on this stack for the call.
            let ready = unsafe { libc::poll(&raw mut pollfd, 1, ms) };
            match ready {
                1.. => return true,
                0 => return false,
                _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
                _ => return false,
            }
        }
    }

    /// Resolves when the process has ended (needs a tokio runtime).
    pub async fn exited(self) -> io::Result<()> {
        // SAFETY: the AsyncFd owns the OwnedFd, whose descriptor stays open
        // and the same until the AsyncFd drops it.
        let fd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(self.0, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        let _ready = fd.readable().await?;
        Ok(())
    }
}

impl AsFd for Pidfd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_reads_ready_when_its_process_ends() {
        let mut child = std::process::Command::new("sleep").arg("0.2").spawn().expect("spawns sleep");
        let pidfd = Pidfd::of(&child).expect("pidfd_open");
        assert!(!pidfd.has_exited(), "sleep still runs");
        assert!(pidfd.wait_timeout(Duration::from_secs(10)), "sleep ends");
        assert!(pidfd.has_exited());
        child.wait().expect("reaps");
    }

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
