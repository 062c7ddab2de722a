//! A cgroup tree, thawed, counted and removed through directory
//! descriptors, at any depth.
//!
//! A sandbox's cgroups are made by moat, but what lies beneath them is
//! partly the sandbox's: its agent makes a cgroup per command, and sandbox
//! root may make more beneath those, as deep as it likes and with names as
//! long as the kernel takes. A walk by path stops at `PATH_MAX` (or at a
//! depth bound) and leaves the rest behind, and then the sandbox's own
//! cgroup cannot be removed either. This walk holds one descriptor at a
//! time (and the names of the directories it has still to visit), steps
//! down by name with `openat(2)` and back up by `..`, and removes with
//! `unlinkat(2)` relative to the parent's descriptor.
//!
//! Climbing by `..` returns to the directory the walk came down from: a
//! cgroup directory cannot be moved to another parent (v1 and v2 rename
//! only within one), cgroupfs holds no symbolic links, and no mount can
//! cover a cgroup directory in the caller's mount namespace (the sandbox
//! mounts in its own). A directory renamed within its parent during the
//! walk is not lost: removing its parent then fails with `EBUSY`, and the
//! parent's children are listed again.
//!
//! No library offers this: the cgroup crates (cgroups-rs, controlgroup)
//! manage cgroups by path and remove one directory at a time.

use std::ffi::{CStr, CString, OsStr};
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{OFlag, openat};
use nix::sys::stat::Mode;

use crate::pidfd::{Pidfd, wait_all};

/// Why a tree could not be thawed or removed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller may not change this cgroup (it belongs to another user,
    /// e.g. one of the sandbox's ids), nor kill what it holds: a process
    /// with rights over those ids must finish the job.
    #[error("cgroup {path}: {what} is refused to this user ({errno}): it belongs to another user")]
    Refused { path: PathBuf, what: &'static str, errno: Errno },
    /// Processes were still in the cgroup when the walk had to stop.
    #[error("cgroup {path} still holds processes")]
    Populated { path: PathBuf },
    #[error("cgroup {path}: {what}: {errno}")]
    Io { path: PathBuf, what: &'static str, errno: Errno },
}

impl Error {
    /// Whether another user's rights (not more time) are what is missing.
    pub fn is_refused(&self) -> bool {
        matches!(self, Self::Refused { .. })
    }
}

/// What [`remove`] does with a cgroup that still holds processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Busy {
    /// Thaw it, SIGKILL each process through a pidfd and wait for them
    /// (until the deadline).
    Kill,
    /// Stop there, with [`Error::Populated`].
    Leave,
}

/// Thaws cgroup v1's freezer in `top` and in every cgroup beneath it, the
/// shallowest first (a child frozen itself stays frozen under a thawed
/// parent; a thawed child under a frozen parent stays frozen). A process
/// frozen by v1 takes no signal, not even SIGKILL, until it is thawed.
/// Nothing to do outside the freezer's hierarchy (one look at `top`), nor
/// where `top` is gone. Thaws all it may; [`Error::Refused`] when some
/// cgroup was not its to thaw.
pub fn thaw(top: &Path) -> Result<(), Error> {
    let mut thaw = Thaw { refused: None };
    walk(top, &mut thaw)?;
    thaw.refused.map_or(Ok(()), Err)
}

/// How many processes `top` and the cgroups beneath it hold (0 when `top`
/// is gone).
pub fn processes(top: &Path) -> Result<usize, Error> {
    let mut count = Count(0);
    walk(top, &mut count)?;
    Ok(count.0)
}

/// Removes `top` and every cgroup beneath it, the deepest first. One that
/// still holds processes is handled as `busy` says, until `deadline`. A
/// `top` that is gone is removed already.
pub fn remove(top: &Path, busy: Busy, deadline: Instant) -> Result<(), Error> {
    walk(top, &mut Remove { busy, deadline })
}

/// Where the walk is: the top's path and the names below it, for messages.
struct Trail<'a> {
    top: &'a Path,
    names: Vec<CString>,
}

impl Trail<'_> {
    fn path(&self) -> PathBuf {
        let mut path = self.top.to_path_buf();
        path.extend(self.names.iter().map(|n| OsStr::from_bytes(n.to_bytes())));
        path
    }

    fn io(&self, what: &'static str, errno: Errno) -> Error {
        match errno {
            Errno::EACCES | Errno::EPERM => Error::Refused { path: self.path(), what, errno },
            _ => Error::Io { path: self.path(), what, errno },
        }
    }
}

/// After a directory's children: done with it, or list its children again
/// (some were made, or renamed, meanwhile).
enum After {
    Done,
    Again,
}

trait Visit {
    /// Before the child `name` of `parent` is opened: whether it is done
    /// with already (a leaf removed at once needs no visit).
    fn skip(&mut self, _parent: BorrowedFd<'_>, _name: &CStr) -> bool {
        false
    }

    /// `dir`, before its children; whether to visit them.
    fn enter(&mut self, dir: BorrowedFd<'_>, at: &Trail<'_>) -> Result<bool, Error>;

    /// `dir`, named `name` in `parent`, after its children.
    fn leave(
        &mut self,
        _parent: BorrowedFd<'_>,
        _name: &CStr,
        _dir: BorrowedFd<'_>,
        _at: &Trail<'_>,
    ) -> Result<After, Error> {
        Ok(After::Done)
    }
}

const DIR: OFlag = OFlag::O_RDONLY.union(OFlag::O_DIRECTORY).union(OFlag::O_NOFOLLOW).union(OFlag::O_CLOEXEC);

fn open_dir(at: BorrowedFd<'_>, name: &CStr) -> nix::Result<OwnedFd> {
    openat(at, name, DIR, Mode::empty())
}

/// The names of the directories in `dir`.
fn subdirs(dir: BorrowedFd<'_>, at: &Trail<'_>) -> Result<Vec<CString>, Error> {
    // A descriptor of its own: the listing moves its position.
    let mut listing = nix::dir::Dir::openat(dir, c".", DIR, Mode::empty()).map_err(|e| at.io("listing", e))?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        let entry = entry.map_err(|e| at.io("listing", e))?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let is_dir = match entry.file_type() {
            Some(kind) => kind == nix::dir::Type::Directory,
            // cgroupfs gives every entry's type; a file system that does
            // not is asked.
            None => nix::sys::stat::fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
                .is_ok_and(|s| s.st_mode & libc::S_IFMT == libc::S_IFDIR),
        };
        if is_dir {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

/// A directory on the way down: its name in its parent, and the names of
/// its children not visited yet.
struct Frame {
    name: CString,
    pending: Vec<CString>,
}

/// Visits `top` and everything beneath it (see the module's comment).
fn walk(top: &Path, visit: &mut impl Visit) -> Result<(), Error> {
    let mut at = Trail { top, names: Vec::new() };
    let (Some(parent), Some(name)) = (top.parent(), top.file_name()) else {
        return Err(Error::Io { path: top.into(), what: "naming its parent", errno: Errno::EINVAL });
    };
    let name = CString::new(name.as_bytes()).map_err(|_| at.io("naming it", Errno::EINVAL))?;
    // The caller's own path, not the sandbox's: opened as given.
    let top_parent = match nix::fcntl::open(parent, DIR, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(at.io("opening its parent", e)),
    };
    let mut dir = match open_dir(top_parent.as_fd(), &name) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(at.io("opening it", e)),
    };
    let pending = if visit.enter(dir.as_fd(), &at)? { subdirs(dir.as_fd(), &at)? } else { Vec::new() };
    let mut stack = vec![Frame { name, pending }];
    while let Some(frame) = stack.last_mut() {
        if let Some(child) = frame.pending.pop() {
            if visit.skip(dir.as_fd(), &child) {
                continue;
            }
            let fd = match open_dir(dir.as_fd(), &child) {
                Ok(fd) => fd,
                // Removed (or renamed) meanwhile.
                Err(Errno::ENOENT) => continue,
                Err(e) => {
                    at.names.push(child);
                    return Err(at.io("opening it", e));
                }
            };
            dir = fd;
            at.names.push(child.clone());
            let pending = if visit.enter(dir.as_fd(), &at)? { subdirs(dir.as_fd(), &at)? } else { Vec::new() };
            stack.push(Frame { name: child, pending });
            continue;
        }
        let Some(frame) = stack.pop() else { break };
        let up = if stack.is_empty() {
            None
        } else {
            Some(open_dir(dir.as_fd(), c"..").map_err(|e| at.io("climbing to its parent", e))?)
        };
        let parent = up.as_ref().map_or(top_parent.as_fd(), AsFd::as_fd);
        match visit.leave(parent, &frame.name, dir.as_fd(), &at)? {
            After::Again => {
                let pending = subdirs(dir.as_fd(), &at)?;
                stack.push(Frame { name: frame.name, pending });
            }
            After::Done => {
                if let Some(up) = up {
                    dir = up;
                    at.names.pop();
                }
            }
        }
    }
    Ok(())
}

/// Opens `file` in the cgroup `dir`; `None` where there is no such file.
fn open_file(dir: BorrowedFd<'_>, file: &CStr, flags: OFlag, at: &Trail<'_>) -> Result<Option<std::fs::File>, Error> {
    match openat(dir, file, flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW, Mode::empty()) {
        Ok(fd) => Ok(Some(fd.into())),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(at.io("opening one of its files", e)),
    }
}

fn read_file(dir: BorrowedFd<'_>, file: &CStr, at: &Trail<'_>) -> Result<Option<String>, Error> {
    let Some(mut opened) = open_file(dir, file, OFlag::O_RDONLY, at)? else { return Ok(None) };
    let mut text = String::new();
    match opened.read_to_string(&mut text) {
        Ok(_) => Ok(Some(text)),
        // Removed meanwhile.
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(at.io("reading one of its files", Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))),
    }
}

/// Writes `THAWED` to `dir`'s `freezer.state` unless it says so already;
/// false where there is no such file.
fn thaw_one(dir: BorrowedFd<'_>, at: &Trail<'_>) -> Result<bool, Error> {
    let Some(state) = read_file(dir, c"freezer.state", at)? else { return Ok(false) };
    if state.trim() != "THAWED"
        && let Some(mut file) = open_file(dir, c"freezer.state", OFlag::O_WRONLY | OFlag::O_TRUNC, at)?
    {
        file.write_all(b"THAWED")
            .map_err(|e| at.io("thawing it", Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
    }
    Ok(true)
}

struct Thaw {
    refused: Option<Error>,
}

impl Visit for Thaw {
    fn enter(&mut self, dir: BorrowedFd<'_>, at: &Trail<'_>) -> Result<bool, Error> {
        match thaw_one(dir, at) {
            // Only the freezer's hierarchy has the file: at the top, its
            // absence spares the other hierarchies a walk.
            Ok(found) => Ok(found || !at.names.is_empty()),
            // The rest is thawed all the same; the caller hears of it.
            Err(e) if e.is_refused() => {
                self.refused.get_or_insert(e);
                Ok(true)
            }
            Err(e) => Err(e),
        }
    }
}

struct Count(usize);

impl Visit for Count {
    fn enter(&mut self, dir: BorrowedFd<'_>, at: &Trail<'_>) -> Result<bool, Error> {
        self.0 += read_file(dir, c"cgroup.procs", at)?.map_or(0, |procs| procs.lines().count());
        Ok(true)
    }
}

struct Remove {
    busy: Busy,
    deadline: Instant,
}

impl Visit for Remove {
    /// Most cgroups are leaves with no process left: one `unlinkat(2)`.
    fn skip(&mut self, parent: BorrowedFd<'_>, name: &CStr) -> bool {
        matches!(
            nix::unistd::unlinkat(parent, name, nix::unistd::UnlinkatFlags::RemoveDir),
            Ok(()) | Err(Errno::ENOENT)
        )
    }

    fn enter(&mut self, _dir: BorrowedFd<'_>, _at: &Trail<'_>) -> Result<bool, Error> {
        Ok(true)
    }

    fn leave(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &CStr,
        dir: BorrowedFd<'_>,
        at: &Trail<'_>,
    ) -> Result<After, Error> {
        loop {
            match nix::unistd::unlinkat(parent, name, nix::unistd::UnlinkatFlags::RemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => return Ok(After::Done),
                // A cgroup with processes or children; a plain directory
                // with children.
                Err(Errno::EBUSY | Errno::ENOTEMPTY) => {}
                Err(e) => return Err(at.io("removing it", e)),
            }
            // A child made meanwhile goes first.
            if !subdirs(dir, at)?.is_empty() {
                return Ok(After::Again);
            }
            if self.busy == Busy::Leave || Instant::now() >= self.deadline {
                return Err(Error::Populated { path: at.path() });
            }
            empty(dir, at, self.deadline)?;
        }
    }
}

/// Kills what the cgroup `dir` holds and waits for it, until `deadline`:
/// each process through a pidfd opened while it was listed there (a pid
/// reused meanwhile is never hit), waited for on that pidfd (the kernel
/// counts a process out of its cgroup before its pidfd reads ready): an
/// event, not a sleep.
fn empty(dir: BorrowedFd<'_>, at: &Trail<'_>, deadline: Instant) -> Result<(), Error> {
    // A frozen process takes no SIGKILL. Refused here, the kill below
    // tells whether that matters.
    let _ = thaw_one(dir, at);
    let listed = || -> Result<Vec<i32>, Error> {
        Ok(read_file(dir, c"cgroup.procs", at)?
            .map(|procs| procs.lines().filter_map(|p| p.trim().parse().ok()).collect())
            .unwrap_or_default())
    };
    let opened: Vec<(i32, Pidfd)> =
        listed()?.into_iter().filter_map(|pid| Pidfd::of_pid(pid).ok().map(|fd| (pid, fd))).collect();
    // Listed again after the pidfds were opened: a pid still there names
    // the process its pidfd was opened on.
    let still = listed()?;
    let mut refused = None;
    let mut killed = Vec::new();
    for (_, fd) in opened.into_iter().filter(|(pid, _)| still.contains(pid)) {
        match fd.kill() {
            Ok(()) => killed.push(fd),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => refused = Some(Errno::EPERM),
            // Gone meanwhile.
            Err(_) => {}
        }
    }
    if !killed.is_empty() {
        wait_all(&killed, deadline);
        return Ok(());
    }
    if let Some(errno) = refused {
        return Err(Error::Refused { path: at.path(), what: "killing its processes", errno });
    }
    wait_unpopulated(dir, at, deadline);
    Ok(())
}

/// The cgroup v1 fallback's pause (see [`wait_unpopulated`]).
const V1_PAUSE: Duration = Duration::from_millis(1);

/// Waits until cgroup `dir`, which lists no process but cannot be removed
/// yet, counts none, or `deadline`. On cgroup v2 that is an event: the
/// kernel signals `cgroup.events` (`populated 0`) to poll(2). cgroup v1 has
/// no such file and no other event a process may wait on (its
/// `notify_on_release` runs a host-wide helper program), so there this is
/// a bounded fallback: one millisecond's pause before the next try. It is
/// reached only in the moment between a process leaving `cgroup.procs` and
/// the kernel's count; the usual path (processes listed, waited for on
/// their pidfds) never sleeps.
fn wait_unpopulated(dir: BorrowedFd<'_>, at: &Trail<'_>, deadline: Instant) {
    let Ok(Some(events)) = open_file(dir, c"cgroup.events", OFlag::O_RDONLY, at) else {
        // The bounded v1 fallback described above.
        std::thread::sleep(V1_PAUSE.min(deadline.saturating_duration_since(Instant::now())));
        return;
    };
    loop {
        let mut buf = [0u8; 256];
        let Ok(read) = std::os::unix::fs::FileExt::read_at(&events, &mut buf, 0) else { return };
        let text = String::from_utf8_lossy(&buf[..read]);
        if !populated(&text) {
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        let mut pollfd = libc::pollfd { fd: events.as_raw_fd(), events: libc::POLLPRI | libc::POLLERR, revents: 0 };
        // SAFETY: one pollfd that lives on this stack for the call.
        if unsafe { libc::poll(&raw mut pollfd, 1, ms) } == 0 {
            return;
        }
    }
}

/// Whether a `cgroup.events` text says the cgroup holds processes.
fn populated(events: &str) -> bool {
    events.lines().any(|l| l.split_whitespace().eq(["populated", "1"]))
}

#[cfg(test)]
mod tests;
