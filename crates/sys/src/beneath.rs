//! Directories and files made beneath a root held by descriptor, where the
//! root's tree is not the caller's to trust.
//!
//! A jail's monitor, as host root (or as the user, rootless), makes the
//! sandbox's mount points and files in the merged root it built over the
//! image: `/dev`, `/tmp`, `/run`, `/.moat`, `/etc/resolv.conf`. The image's
//! files belong to the jail's id range, not to moat: a symlink there
//! (`.moat -> /etc`) followed by path text would have host root create,
//! `chown` or remove host files. So every name is resolved from the root's
//! descriptor by the kernel (`openat2` with `RESOLVE_BENEATH`), and no
//! symlink is followed on the way or at the end (`RESOLVE_NO_SYMLINKS`,
//! `O_NOFOLLOW`): a path that holds one is refused with `ELOOP`. What is
//! made is then used through its descriptor: a mount's target is its
//! `/proc/self/fd` entry, an owner set with `fchownat(AT_EMPTY_PATH)`.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

/// What every lookup here refuses: leaving the root, and any symlink.
fn resolve() -> ResolveFlag {
    ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS
}

/// `rel`'s plain names, or `EINVAL` for one that is not (`..`, `/`, `.`).
fn names(rel: &Path) -> io::Result<Vec<&OsStr>> {
    rel.components()
        .map(|c| match c {
            Component::Normal(name) => Ok(name),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a relative path of names", rel.display()),
            )),
        })
        .collect()
}

/// Opens `rel` beneath `root` with `flags` (close-on-exec added), refusing
/// any symlink; retried while a rename elsewhere races the lookup.
pub fn open(root: BorrowedFd<'_>, rel: &Path, flags: OFlag, mode: Mode) -> io::Result<OwnedFd> {
    let how = OpenHow::new().flags(flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW).mode(mode).resolve(resolve());
    let target = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
    let mut result = nix::fcntl::openat2(root, target, how);
    for _ in 0..16 {
        if !matches!(result, Err(Errno::EAGAIN)) {
            break;
        }
        result = nix::fcntl::openat2(root, target, how);
    }
    result.map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("opening {} ({e})", rel.display())))
}

/// The directory `rel` beneath `root`, as an `O_PATH` descriptor.
pub fn dir(root: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    open(root, rel, OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty())
}

/// Makes the directory `rel` and those above it beneath `root` (mode 0755
/// for each made), keeping those that exist, and returns it as an `O_PATH`
/// descriptor. A symlink anywhere on the way is refused.
pub fn make_dirs(root: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    let mut at = dir(root, Path::new(""))?;
    for name in names(rel)? {
        match nix::sys::stat::mkdirat(at.as_fd(), name, Mode::from_bits_truncate(0o755)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(io::Error::new(io::Error::from(e).kind(), format!("making {} ({e})", rel.display()))),
        }
        at = dir(at.as_fd(), Path::new(name))?;
    }
    Ok(at)
}

/// Makes (or empties) the regular file `name` in `parent` for writing; a
/// symlink of that name is refused, and so is anything else that is not a
/// regular file (a FIFO is opened without waiting for a reader, and
/// refused: it would hold the caller until one came).
pub fn create_file(parent: BorrowedFd<'_>, name: &str) -> io::Result<std::fs::File> {
    let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_NONBLOCK;
    let file = std::fs::File::from(open(parent, Path::new(name), flags, Mode::from_bits_truncate(0o644))?);
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name} is not a regular file")));
    }
    file.set_len(0)?;
    Ok(file)
}

/// Removes `name` from `parent` if it is there (a symlink itself, never
/// what it points to).
pub fn remove_file(parent: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    match nix::unistd::unlinkat(parent, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Makes the symlink `name` in `parent`, pointing at `target`.
pub fn symlink(parent: BorrowedFd<'_>, name: &str, target: &str) -> io::Result<()> {
    nix::unistd::symlinkat(target, parent, name).map_err(io::Error::from)
}

/// The path through which `fd`'s file is reached (its `/proc/self/fd`
/// entry): a mount's target or a `chmod`'s, with nothing left to resolve.
pub fn path_of(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Sets the owner of `fd`'s file itself.
pub fn chown(fd: &OwnedFd, uid: u32, gid: u32) -> io::Result<()> {
    let empty = CString::default();
    // SAFETY: fchownat on a descriptor this caller owns, with an empty
    // path (AT_EMPTY_PATH: the descriptor's own file), a valid C string.
    let done = unsafe { libc::fchownat(fd.as_raw_fd(), empty.as_ptr(), uid, gid, libc::AT_EMPTY_PATH) };
    if done == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Sets the mode of `fd`'s file (through [`path_of`]: `fchmod` takes no
/// `O_PATH` descriptor).
pub fn chmod(fd: &OwnedFd, mode: u32) -> io::Result<()> {
    let path = CString::new(path_of(fd).as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: chmod of a NUL-terminated path that names this process's
    // own descriptor.
    if unsafe { libc::chmod(path.as_ptr(), mode) } == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// An `O_PATH` descriptor of the directory at `path` (a root the caller
/// made itself, such as a tmpfs it mounted).
pub fn open_root(path: &Path) -> io::Result<OwnedFd> {
    nix::fcntl::open(path, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("opening {} ({e})", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_made_or_written_through_a_symlink() {
        let tmp = tempfile::tempdir().expect("a directory");
        let (root, outside) = (tmp.path().join("root"), tmp.path().join("outside"));
        std::fs::create_dir_all(root.join("etc")).expect("etc");
        std::fs::create_dir(&outside).expect("outside");
        std::os::unix::fs::symlink(&outside, root.join(".moat")).expect("an absolute link");
        std::os::unix::fs::symlink("../outside", root.join("tmp")).expect("a relative link");
        std::os::unix::fs::symlink("etc", root.join("conf")).expect("a link inside the root");
        std::os::unix::fs::symlink(outside.join("passwd"), root.join("etc/resolv.conf")).expect("a link as the file");
        let fd = open_root(&root).expect("the root");
        let root_fd = fd.as_fd();
        for (rel, why) in [(".moat/old", "absolute link"), ("tmp", "relative link"), ("conf/x", "link inside")] {
            let refused = make_dirs(root_fd, Path::new(rel)).expect_err(why);
            assert_eq!(refused.raw_os_error(), None, "wrapped with the path: {refused}");
            assert!(refused.to_string().contains(rel.split('/').next().unwrap_or(rel)), "{refused}");
        }
        assert!(make_dirs(root_fd, Path::new("../outside/x")).is_err(), "no way up");
        let etc = dir(root_fd, Path::new("etc")).expect("etc");
        assert!(create_file(etc.as_fd(), "resolv.conf").is_err(), "the link is not written through");
        nix::unistd::mkfifo(&root.join("etc/fifo"), Mode::from_bits_truncate(0o644)).expect("a FIFO");
        assert!(create_file(etc.as_fd(), "fifo").is_err(), "a FIFO is refused, not waited on");
        remove_file(etc.as_fd(), "resolv.conf").expect("the link itself goes");
        std::io::Write::write_all(&mut create_file(etc.as_fd(), "resolv.conf").expect("made"), b"nameserver 1\n")
            .expect("written");
        assert_eq!(std::fs::read_dir(&outside).expect("listed").count(), 0, "nothing was made outside");
        assert!(!outside.join("passwd").exists());
        // What is not a link is made and used by descriptor.
        let made = make_dirs(root_fd, Path::new("a/b/c")).expect("made");
        chmod(&made, 0o700).expect("chmod");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(root.join("a/b/c")).expect("there").permissions().mode() & 0o777, 0o700);
        assert!(make_dirs(root_fd, Path::new("a/b/c")).is_ok(), "what exists is kept");
        symlink(made.as_fd(), "fd", "/proc/self/fd").expect("a link made on purpose");
        assert_eq!(std::fs::read_link(root.join("a/b/c/fd")).expect("read"), Path::new("/proc/self/fd"));
    }
}
