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

    /// A pidfd of `child`, which must not be reaped yet (its pid then still
    /// names it: no race with a recycled pid).
    pub fn of(child: &std::process::Child) -> io::Result<Self> {
        Self::of_pid(i32::try_from(child.id()).map_err(|_| io::Error::other("pid out of range"))?)
    }

    /// Another descriptor of the same process, for a second waiter.
    pub fn try_clone(&self) -> io::Result<Self> {
        self.0.try_clone().map(Self)
    }

    /// Whether the process has ended, without waiting.
    pub fn has_exited(&self) -> bool {
        self.wait_timeout(std::time::Duration::ZERO)
    }

    /// Blocks until the process has ended or `timeout` has passed; true
    /// when it has ended.
    pub fn wait_timeout(&self, timeout: std::time::Duration) -> bool {
        wait_all(std::slice::from_ref(self), Instant::now() + timeout)
    }

    /// The descriptor, for a reactor to wait on.
    pub fn into_fd(self) -> OwnedFd {
        self.0
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

impl std::os::fd::AsFd for Pidfd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.0)
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

    #[test]
    fn a_pidfd_reads_ready_when_its_process_ends() {
        let mut child = std::process::Command::new("sleep").arg("0.2").spawn().expect("spawns sleep");
        let pidfd = Pidfd::of(&child).expect("pidfd_open");
        assert!(!pidfd.has_exited(), "sleep still runs");
        assert!(pidfd.wait_timeout(Duration::from_secs(10)), "sleep ends");
        assert!(pidfd.has_exited());
        child.wait().expect("reaps");
    }

    #[test]
    fn many_pidfds_are_waited_on_together_and_killed_by_descriptor() {
        let mut short = std::process::Command::new("sleep").arg("0.1").spawn().expect("spawns sleep");
        let mut long = std::process::Command::new("sleep").arg("30").spawn().expect("spawns sleep");
        let pid = |c: &std::process::Child| i32::try_from(c.id()).expect("a pid fits");
        let pidfds = [Pidfd::of_pid(pid(&short)).expect("pidfd_open"), Pidfd::of_pid(pid(&long)).expect("pidfd_open")];
        assert!(!wait_all(&pidfds, Instant::now() + Duration::from_millis(300)), "sleep 30 outlives the wait");
        assert!(pidfds[0].has_exited() && !pidfds[1].has_exited());
        pidfds[1].kill().expect("pidfd_send_signal");
        assert!(wait_all(&pidfds, Instant::now() + Duration::from_secs(10)), "both have ended");
        short.wait().expect("reaps");
        assert!(long.wait().expect("reaps").code().is_none(), "killed by a signal");
    }
}
