//! Waiting for processes to end by event: a pidfd (`pidfd_open(2)`, Linux
//! 5.3) reads ready when its process has ended, and a signal sent through
//! it never reaches a process that reused the pid.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Instant;

/// A pidfd of a process.
#[derive(Debug)]
pub struct Pidfd(OwnedFd);

impl Pidfd {
    /// A pidfd of process `pid` (of this pid namespace). The pid may have
    /// been reused by the time this returns: callers check that it still
    /// names the process they meant.
    pub fn of_pid(pid: i32) -> io::Result<Self> {
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

    /// Sends SIGKILL to the process (never to one that reused its pid).
    pub fn kill(&self) -> io::Result<()> {
        // SAFETY: pidfd_send_signal on a descriptor this value owns, with no
        // siginfo (null) and no flags.
        let done = unsafe {
            libc::syscall(libc::SYS_pidfd_send_signal, self.0.as_raw_fd(), libc::SIGKILL, std::ptr::null::<u8>(), 0)
        };
        if done < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }

    /// Whether the process has not been reaped, so that its pid is still
    /// its own (signal 0 through the pidfd; never true of a process that
    /// reused the pid).
    pub fn is_alive(&self) -> bool {
        // SAFETY: pidfd_send_signal on a descriptor this value owns, with
        // signal 0 (nothing sent, only checked), no siginfo and no flags.
        let done =
            unsafe { libc::syscall(libc::SYS_pidfd_send_signal, self.0.as_raw_fd(), 0, std::ptr::null::<u8>(), 0) };
        done == 0
    }
}

impl std::os::fd::AsRawFd for Pidfd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// Blocks until every process of `pidfds` has ended or `deadline` has
/// passed; true when all have ended.
pub fn wait_all(pidfds: &[Pidfd], deadline: Instant) -> bool {
    let mut pending: Vec<&Pidfd> = pidfds.iter().collect();
    while !pending.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut polled: Vec<libc::pollfd> =
            pending.iter().map(|p| libc::pollfd { fd: p.0.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
        let ms = libc::c_int::try_from(left.as_millis().max(u128::from(!left.is_zero()))).unwrap_or(libc::c_int::MAX);
        let count = libc::nfds_t::try_from(polled.len()).unwrap_or(libc::nfds_t::MAX);
        // SAFETY: `polled` holds `count` pollfds and lives across the call.
        let ready = unsafe { libc::poll(polled.as_mut_ptr(), count, ms) };
        match ready {
            1.. => {
                let mut ended = polled.iter().map(|p| p.revents != 0);
                pending.retain(|_| !ended.next().unwrap_or(false));
            }
            0 => return false,
            _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn processes_are_killed_by_descriptor_and_their_ends_awaited() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawns sleep");
        let pidfd = Pidfd::of_pid(i32::try_from(child.id()).expect("a pid fits")).expect("pidfd_open");
        let pidfds = [pidfd];
        assert!(!wait_all(&pidfds, Instant::now() + Duration::from_millis(50)), "sleep 30 still runs");
        pidfds[0].kill().expect("pidfd_send_signal");
        assert!(wait_all(&pidfds, Instant::now() + Duration::from_secs(10)), "a killed process ends");
        assert!(child.wait().expect("reaps").code().is_none());
    }
}
