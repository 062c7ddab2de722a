//! Descriptors a moat process inherited from whatever started it.

/// Marks every descriptor this process inherited beyond stdio
/// close-on-exec, so that none reaches a program it starts (from moat and
/// moat-mcp: the jail's monitor, and through it the sandbox; moat-vmm;
/// pasta, passt, git; from the monitor: pasta): what the parent left open
/// without the flag (a supervisor's socket, a shell's redirection, an
/// editor's pipe, a test harness's jobserver) is the parent's business,
/// never a sandbox's. Descriptors a process hands a program on purpose are
/// put in place after this (`dup2` in the child). Called first thing by
/// each binary, while it has no thread.
pub fn keep_inherited_descriptors_to_this_process() {
    // SAFETY: close_range(2) with CLOSE_RANGE_CLOEXEC changes only the
    // flags of this process's descriptors, closing none.
    let done = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) };
    if done != 0 {
        // Linux before 5.11: no flag. Each open descriptor then, one by one.
        for fd in open_above(2).unwrap_or_default() {
            // SAFETY: fcntl(F_SETFD) on a descriptor number; one that is
            // not open (the listing's own, gone by now) fails harmlessly.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
    }
}

/// The descriptors this process has open above `lowest`, as `/proc/self/fd`
/// lists them (the listing's own among them, closed by the time this
/// returns): for kernels whose `close_range(2)` lacks what a caller needs.
pub fn open_above(lowest: i32) -> std::io::Result<Vec<i32>> {
    Ok(std::fs::read_dir("/proc/self/fd")?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > lowest)
        .collect())
}

/// The most a helper's log may hold: what pasta and passt write to the
/// file their stderr goes to in the sandbox's state directory.
pub const HELPER_LOG_MAX: u64 = 1 << 20;

/// Caps every file this process (and what it execs) writes at `bytes`:
/// writes past it fail (`EFBIG`) rather than grow the file, and do not kill
/// the writer (`SIGXFSZ` ignored, which an exec keeps). For a helper that
/// logs what sandbox traffic makes it say (pasta, passt) into a host file:
/// a sandbox could otherwise fill the host's disk through it. For use
/// between fork and exec (async-signal-safe: `signal` and `setrlimit`).
pub fn cap_file_writes(bytes: u64) -> std::io::Result<()> {
    let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
    // SAFETY: signal(2) with a constant disposition and setrlimit(2) with a
    // value on this stack; both are async-signal-safe.
    let done = unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN) != libc::SIG_ERR
            && libc::setrlimit(libc::RLIMIT_FSIZE, &raw const limit) == 0
    };
    if done { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// A helper told to write more than the cap leaves a log of the cap's
    /// size and goes on (its writes fail; it is not killed).
    #[test]
    fn a_capped_helper_writes_no_more_than_the_cap_and_lives() {
        use std::os::unix::process::{CommandExt, ExitStatusExt};
        let dir = tempfile::tempdir().expect("a directory");
        let log = dir.path().join("helper.log");
        let mut command = std::process::Command::new("sh");
        command.args(["-c", "head -c 3000000 /dev/zero >&2; echo still here"]);
        command.stderr(std::fs::File::create(&log).expect("the log"));
        command.stdout(std::process::Stdio::piped());
        // SAFETY: cap_file_writes is async-signal-safe.
        unsafe { command.pre_exec(|| cap_file_writes(HELPER_LOG_MAX)) };
        let out = command.output().expect("sh runs");
        assert_eq!(out.status.signal(), None, "killed: {:?}", out.status);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "still here\n");
        assert_eq!(std::fs::metadata(&log).expect("the log").len(), HELPER_LOG_MAX);
    }

    #[test]
    fn an_inherited_descriptor_reaches_no_program_this_process_starts() {
        // SAFETY: pipe2 writes two descriptors into the array; each is
        // moved to a number no program's own descriptors would take (a
        // child's `ls` opens its directory at 3), and owned below.
        let ends = unsafe {
            let mut fds = [0; 2];
            assert_eq!(libc::pipe2(fds.as_mut_ptr(), 0), 0, "pipe2");
            for (fd, high) in fds.iter_mut().zip([300, 301]) {
                assert_eq!(libc::dup2(*fd, high), high, "dup2");
                libc::close(*fd);
                *fd = high;
            }
            fds.map(|fd| OwnedFd::from_raw_fd(fd))
        };
        let flags = |fd: &OwnedFd| {
            // SAFETY: F_GETFD on a descriptor this test owns.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) }
        };
        assert_eq!(flags(&ends[0]) & libc::FD_CLOEXEC, 0, "inherited as it would be: without the flag");
        keep_inherited_descriptors_to_this_process();
        assert!(ends.iter().all(|fd| flags(fd) & libc::FD_CLOEXEC != 0), "still inheritable");
        let shown = std::process::Command::new("ls").arg("/proc/self/fd").output().expect("ls");
        let listed = String::from_utf8_lossy(&shown.stdout).split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        let read_end = ends[0].as_raw_fd().to_string();
        assert!(!listed.contains(&read_end), "a child holds descriptor {read_end}: {listed:?}");
    }
}
