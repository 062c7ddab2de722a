//! A rootless user's held user namespace: the mapping `newuidmap` and
//! `newgidmap` make, made once and joined by later jails.
//!
//! A rootless monitor works from a user namespace of the user's own whose
//! ids 1 onwards are the user's subordinate ranges ([`crate::jail`]).
//! Mapping one takes Debian's two set-uid helpers, an exec of a set-uid
//! program each: about 2 ms of a 15 ms jail start. So the first monitor
//! that maps a namespace forks a holder, a small process that stays in it
//! and hands a descriptor of it to later monitors of the same user over a
//! socket in the user's data directory (mode 0700), as rootless Podman's
//! pause process does. A later monitor joins it with setns(2) instead of
//! mapping a namespace of its own; each sandbox still gets a user
//! namespace of its own beneath it.
//!
//! Sharing it gives nothing away: the namespace holds the user's own id
//! and the subordinate ranges that every sandbox of that user maps
//! anyway, and the user could make the same one with the same helpers.
//! Nor can it be used against the monitor:
//!
//! - the holder serves only its own user (`SO_PEERCRED`);
//! - a monitor joins only a namespace whose maps are exactly those it
//!   would have written, read from the holder's `/proc` entries and tied
//!   to the received descriptor by its inode, with the holder known alive
//!   throughout by a pidfd;
//! - any failure (no holder, a stale socket, other maps, a holder that does
//!   not answer within [`ANSWER`]) only means the monitor maps its own, as
//!   it did before holders.
//!
//! The holder ends after a while without a request ([`Rootless`]'s
//! `hold`); jails that joined keep the namespace alive by
//! themselves. It runs in a session of its own, outside every sandbox's
//! cgroups, with no descriptor of the monitor's but its two.
//!
//! [`Rootless`]: crate::jail::Rootless

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg, sockopt};

/// How long either side waits for the other within one hand-over.
pub const ANSWER: Duration = Duration::from_secs(2);

/// The id maps of a user namespace, as `/proc/PID/uid_map` and `gid_map`
/// list them: (first id inside, first id outside, count) per line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Maps {
    pub uid: Vec<[u64; 3]>,
    pub gid: Vec<[u64; 3]>,
}

impl Maps {
    /// The same maps in a fixed order (the kernel may list them sorted).
    #[must_use]
    pub fn sorted(mut self) -> Self {
        self.uid.sort_unstable();
        self.gid.sort_unstable();
        self
    }
}

/// Reads a `uid_map`/`gid_map` text; `None` if it is not one.
pub fn parse_map(text: &str) -> Option<Vec<[u64; 3]>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut fields = line.split_whitespace().map(str::parse::<u64>);
            let map = [fields.next()?.ok()?, fields.next()?.ok()?, fields.next()?.ok()?];
            fields.next().is_none().then_some(map)
        })
        .collect()
}

/// Joins the user namespace that the holder at `socket` holds, if its maps
/// are `want`. Must be called while the process is single-threaded (setns
/// into a user namespace requires it). An error says why not, for the
/// jail's log; the caller then maps a namespace of its own.
pub fn join(socket: &Path, want: &Maps) -> Result<(), String> {
    let stream = UnixStream::connect(socket).map_err(|e| format!("no holder at {} ({e})", socket.display()))?;
    stream.set_read_timeout(Some(ANSWER)).map_err(|e| format!("setting a timeout: {e}"))?;
    let peer = nix::sys::socket::getsockopt(&stream, sockopt::PeerCredentials)
        .map_err(|e| format!("reading the holder's credentials: {e}"))?;
    if peer.uid() != nix::unistd::getuid().as_raw() {
        return Err(format!("the socket's owner is uid {}, not this user", peer.uid()));
    }
    // The holder stays alive until this end closes: the pidfd, opened now,
    // proves below that what was read of `peer.pid()` was read of it.
    let holder = crate::pidfd::Pidfd::of_pid(peer.pid()).map_err(|e| format!("pidfd of the holder: {e}"))?;
    let ns = receive_fd(&stream)?;
    let ns_stat = nix::sys::stat::fstat(ns.as_fd()).map_err(|e| format!("fstat of the namespace: {e}"))?;
    let proc = format!("/proc/{}", peer.pid());
    let peer_ns = std::fs::metadata(format!("{proc}/ns/user")).map_err(|e| format!("the holder's namespace: {e}"))?;
    if (peer_ns.dev(), peer_ns.ino()) != (ns_stat.st_dev, ns_stat.st_ino) {
        return Err("the descriptor is not the holder's own user namespace".into());
    }
    let read_map = |name: &str| {
        std::fs::read_to_string(format!("{proc}/{name}"))
            .ok()
            .and_then(|text| parse_map(&text))
            .ok_or_else(|| format!("cannot read the holder's {name}"))
    };
    let held = Maps { uid: read_map("uid_map")?, gid: read_map("gid_map")? }.sorted();
    if !holder.is_alive() {
        return Err("the holder ended while it was checked".into());
    }
    if held != want.clone().sorted() {
        return Err(format!("the held namespace maps {held:?}, not {want:?}"));
    }
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWUSER).map_err(|e| format!("setns: {e}"))
}

/// Receives the one descriptor a holder sends.
fn receive_fd(stream: &UnixStream) -> Result<OwnedFd, String> {
    let mut byte = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| format!("receiving the namespace: {e}"))?;
    let mut received = None;
    for cmsg in msg.cmsgs().map_err(|e| format!("reading the namespace's message: {e}"))? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            for fd in fds {
                // SAFETY: the kernel just installed `fd` in this process for
                // this message; nothing else owns it. Each is owned once,
                // and all but the first are closed on drop.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                received.get_or_insert(owned);
            }
        }
    }
    received.ok_or_else(|| "the holder sent no descriptor".into())
}

/// Forks the holder of this process's user namespace (mapped just now),
/// serving at `socket` until `idle` passes without a request. Must be
/// called while the process is single-threaded. A socket left there by a
/// holder that ended is replaced; one a live holder serves is replaced
/// too (the two then race harmlessly: each serves the same maps).
pub fn start(socket: &Path, idle: Duration) -> std::io::Result<()> {
    let ns = File::open("/proc/self/ns/user")?;
    // SAFETY: the caller's contract: this process is single-threaded, so
    // the child holds no lock another thread owned. The child forks once
    // more and exits; the grandchild serves and exits without returning.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => {
            let _ = nix::unistd::setsid();
            // SAFETY: as above; this child is single-threaded too.
            if let Ok(nix::unistd::ForkResult::Child) = unsafe { nix::unistd::fork() } {
                // The holder itself listens: SO_PEERCRED names the process
                // that called listen(2), which a monitor checks.
                match listen(socket) {
                    Ok((listener, bound)) => serve(listener, ns, socket, bound, idle),
                    // Still the monitor's stderr, its log.
                    Err(e) => eprintln!("moat-agent jail: no namespace holder at {} ({e})", socket.display()),
                }
            }
            // SAFETY: _exit(2) ends this process without running the
            // monitor's exit handlers or destructors twice.
            unsafe { libc::_exit(0) }
        }
        nix::unistd::ForkResult::Parent { child } => {
            // The middle process exits at once: the holder is nobody's child
            // here, and the monitor reaps the one it forked.
            let _ = nix::sys::wait::waitpid(child, None);
            Ok(())
        }
    }
}

/// Binds and listens at `socket`, mode 0600, replacing what is there; the
/// socket's device and inode, to tell it from a later holder's.
fn listen(socket: &Path) -> std::io::Result<(UnixListener, (u64, u64))> {
    // Bound beside its final name and renamed over it, so that a monitor
    // never finds the path bound but not yet listening.
    let name = socket.file_name().and_then(|n| n.to_str()).unwrap_or("userns.sock");
    let tmp = socket.with_file_name(format!(".{name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp)?;
    // Only its user may connect (connect(2) needs write permission), on
    // top of the holder's own check of who connected.
    let placed = std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .and_then(|()| std::fs::metadata(&tmp))
        .and_then(|bound| std::fs::rename(&tmp, socket).map(|()| (bound.dev(), bound.ino())));
    match placed {
        Ok(bound) => Ok((listener, bound)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The holder's life: answers requests until `idle` passes without one,
/// then removes its socket (if it is still its own) and returns.
fn serve(listener: UnixListener, ns: File, socket: &Path, bound: (u64, u64), idle: Duration) {
    keep_only(&[listener.as_raw_fd(), ns.as_raw_fd()]);
    // Named for ps(1) and top(1), which would say moat-agent.
    let _ = nix::sys::prctl::set_name(c"moat-userns");
    let _ = std::env::set_current_dir("/");
    let own_uid = nix::unistd::getuid().as_raw();
    let idle_ms = libc::c_int::try_from(idle.as_millis()).unwrap_or(libc::c_int::MAX);
    loop {
        let mut polled = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd that lives across the call.
        match unsafe { libc::poll(&raw mut polled, 1, idle_ms) } {
            0 => break,
            1.. => {}
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => continue,
            _ => break,
        }
        let Ok((stream, _)) = listener.accept() else { continue };
        let allowed = nix::sys::socket::getsockopt(&stream, sockopt::PeerCredentials).is_ok_and(|c| c.uid() == own_uid);
        if allowed {
            hand_over(&stream, &ns);
        }
    }
    if std::fs::metadata(socket).is_ok_and(|m| (m.dev(), m.ino()) == bound) {
        // A new holder could rename its socket over this one between the
        // check and the removal: a later monitor then maps its own and
        // starts another holder. Nothing worse.
        let _ = std::fs::remove_file(socket);
    }
}

/// Sends `ns` on `stream` and waits (at most [`ANSWER`]) for the monitor
/// to close its end, so that it can check this process while it lives.
fn hand_over(stream: &UnixStream, ns: &File) {
    let fds = [ns.as_raw_fd()];
    let iov = [std::io::IoSlice::new(b"n")];
    let sent =
        sendmsg::<()>(stream.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::MSG_NOSIGNAL, None);
    if sent.is_ok() && stream.set_read_timeout(Some(ANSWER)).is_ok() {
        let mut rest = [0u8; 16];
        let mut reader = stream;
        while matches!(reader.read(&mut rest), Ok(n) if n > 0) {}
    }
}

/// Closes every descriptor of this process but `keep`, and points the
/// standard streams at /dev/null: the holder holds nothing of the monitor's
/// (its readiness pipe to the host above all, whose end the host reads).
fn keep_only(keep: &[RawFd]) {
    let open: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    for fd in open.into_iter().filter(|fd| !keep.contains(fd)) {
        // SAFETY: closing a descriptor number this single-threaded process
        // holds and will not use again; the ones it keeps are skipped.
        unsafe { libc::close(fd) };
    }
    if let Ok(null) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null") {
        for target in 0..3 {
            // SAFETY: dup2 onto the standard descriptors, closed above.
            unsafe { libc::dup2(null.as_raw_fd(), target) };
        }
        if null.as_raw_fd() < 3 {
            std::mem::forget(null);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_are_read_as_the_kernel_lists_them() {
        let text = "         0       1001          1\n         1     100000      65536\n";
        assert_eq!(parse_map(text), Some(vec![[0, 1001, 1], [1, 100_000, 65536]]));
        assert_eq!(parse_map(""), Some(vec![]));
        assert_eq!(parse_map("0 1001"), None);
        assert_eq!(parse_map("0 1001 1 7"), None);
        assert_eq!(parse_map("0 x 1"), None);
    }

    #[test]
    fn nobody_at_the_socket_is_an_error_not_a_wait() {
        let dir = tempfile::tempdir().expect("a directory");
        let want = Maps { uid: vec![], gid: vec![] };
        let missing = join(&dir.path().join("userns.sock"), &want).expect_err("nothing listens");
        assert!(missing.contains("no holder"), "{missing}");
        // A socket whose listener is gone.
        drop(UnixListener::bind(dir.path().join("stale.sock")).expect("bind"));
        let stale = join(&dir.path().join("stale.sock"), &want).expect_err("nothing listens");
        assert!(stale.contains("no holder"), "{stale}");
    }
}
