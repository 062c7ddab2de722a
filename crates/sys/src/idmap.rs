//! An image's tree seen through an id mapping: the lower layer of a jail
//! whose ids are not the ones the image's files are owned by.
//!
//! As root, each jail maps a host id range of its own (so that what the
//! kernel counts per user, inotify instances, queued signals, message
//! queues, is counted per sandbox), while the image's files are owned from
//! one range, the image's. An idmapped bind mount (Linux 5.12; as an
//! overlay's lower layer, 5.19) shows the tree with every owner moved from
//! the image's range to the jail's, without a write to the image.
//!
//! The new mount API has no wrapper in nix: the three calls are made here.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Ids `from..from + count` of a tree shown as `to..to + count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shift {
    pub from: u32,
    pub to: u32,
    pub count: u32,
}

impl Shift {
    /// The line of `uid_map` and `gid_map` that makes this shift: the
    /// mapping's own ids are the tree's, its host ids the jail's.
    fn map_line(self) -> String {
        format!("{} {} {}\n", self.from, self.to, self.count)
    }
}

/// Why a jail's overlay cannot take the tree at `path` through an idmapped
/// mount on this host, if it cannot: overlayfs takes idmapped lower layers
/// from Linux 5.19, and only some file systems idmap (ext4, xfs and btrfs
/// by then; tmpfs from 6.3). Decided from the kernel's release and the file
/// system's type, without trying (the host tries once besides, before it
/// relies on it: `moat_core::backend::ids::shared_because`).
pub fn unsupported(path: &Path) -> Option<String> {
    static RELEASE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let release = RELEASE
        .get_or_init(|| std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned());
    let version = kernel_version(release);
    if version < (5, 19) {
        return Some(format!("Linux {release} has no idmapped overlay layers (5.19 or later has)"));
    }
    let fs = match nix::sys::statfs::statfs(path) {
        Ok(fs) => fs.filesystem_type().0,
        Err(e) => return Some(format!("cannot tell the file system of {}: {e}", path.display())),
    };
    let supported = match fs {
        EXT4 | XFS | BTRFS => true,
        TMPFS => version >= (6, 3),
        _ => false,
    };
    (!supported).then(|| {
        format!(
            "{} is on a file system (type {fs:#x}) that Linux {release} cannot idmap; ext4, xfs and btrfs can, \
             and tmpfs from Linux 6.3",
            path.display()
        )
    })
}

const EXT4: i64 = 0xEF53;
const XFS: i64 = 0x5846_5342;
const BTRFS: i64 = 0x9123_683E;
const TMPFS: i64 = 0x0102_1994;

/// (major, minor) of a kernel release such as `6.1.0-28-amd64`; (0, 0)
/// where it does not parse.
fn kernel_version(release: &str) -> (u32, u32) {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let mut next = || parts.next().and_then(|p| p.parse().ok());
    match (next(), next()) {
        (Some(major), Some(minor)) => (major, minor),
        _ => (0, 0),
    }
}

/// Mounts `tree` at `target` (an existing directory), read-only, with its
/// owners shifted. Needs host root.
pub fn mount_shifted(tree: &Path, target: &Path, shift: Shift) -> io::Result<()> {
    let detached = shifted_tree(tree, shift)?;
    let empty = c"";
    let target = path_c(target)?;
    // SAFETY: move_mount(2) of the detached mount we own onto a
    // NUL-terminated path; it reads both and writes nothing of ours.
    let moved = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            detached.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if moved != 0 {
        return Err(with_context(io::Error::last_os_error(), "move_mount"));
    }
    Ok(())
}

/// Whether an idmapped mount of `tree` shifted by `shift` can be made
/// here: made, detached, and dropped, touching no mount namespace.
pub fn try_shift(tree: &Path, shift: Shift) -> io::Result<()> {
    shifted_tree(tree, shift).map(drop)
}

/// A detached, read-only copy of the mount at `tree` with its owners
/// shifted. The user namespace the mapping needs comes from a clone of the
/// calling thread that runs only close(2) and read(2) (async-signal-safe),
/// so a multi-threaded caller may use it too.
fn shifted_tree(tree: &Path, shift: Shift) -> io::Result<OwnedFd> {
    let userns = mapping_namespace(shift)?;
    let detached = open_tree_clone(tree)?;
    let attr = libc::mount_attr {
        attr_set: libc::MOUNT_ATTR_IDMAP | libc::MOUNT_ATTR_RDONLY,
        attr_clr: 0,
        propagation: 0,
        userns_fd: u64::try_from(userns.as_raw_fd()).unwrap_or(u64::MAX),
    };
    let empty = c"";
    // SAFETY: mount_setattr(2) on a descriptor we own, with a NUL-terminated
    // empty path and a `mount_attr` of the size passed, which it only reads.
    let set = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            detached.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            &raw const attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if set != 0 {
        return Err(with_context(io::Error::last_os_error(), "mount_setattr(MOUNT_ATTR_IDMAP)"));
    }
    Ok(detached)
}

fn with_context(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn path_c(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::other("a path with a NUL byte"))
}

/// A detached copy of the mount at `tree` (a bind mount of it), which
/// mount_setattr(2) may still idmap.
fn open_tree_clone(tree: &Path) -> io::Result<OwnedFd> {
    let path = path_c(tree)?;
    // SAFETY: open_tree(2) reads the NUL-terminated path; on success the
    // descriptor it returns is ours alone.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(with_context(io::Error::last_os_error(), "open_tree(OPEN_TREE_CLONE)"));
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("open_tree returned no descriptor"))?;
    // SAFETY: a new descriptor, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A user namespace mapped by `shift`, as a descriptor: made by a clone of
/// this process that waits, in the namespace, until the maps are written
/// and the namespace is opened, then exits.
fn mapping_namespace(shift: Shift) -> io::Result<OwnedFd> {
    let (release_rx, release_tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (rx, tx) = (release_rx.as_raw_fd(), release_tx.as_raw_fd());
    let mut stack = vec![0u8; 16 * 1024];
    let child = Box::new(move || {
        // SAFETY: in the clone (a copy of the process in which only this
        // thread runs): it closes its copy of the pipe's write end and
        // waits for the parent's to close, using only close(2), read(2)
        // and its own buffer, all async-signal-safe.
        unsafe {
            libc::close(tx);
            let mut byte = 0u8;
            while libc::read(rx, (&raw mut byte).cast(), 1) < 0 && *libc::__errno_location() == libc::EINTR {}
        }
        0
    });
    // SAFETY: the clone is a copy of this process in which only the
    // calling thread runs, and it runs only the closure above: close(2)
    // and read(2), async-signal-safe, so no lock another thread held at
    // the clone is ever needed; it ends by returning.
    let pid =
        unsafe { nix::sched::clone(child, &mut stack, nix::sched::CloneFlags::CLONE_NEWUSER, Some(libc::SIGCHLD)) }?;
    let opened = (|| {
        let line = shift.map_line();
        std::fs::write(format!("/proc/{pid}/uid_map"), &line)
            .map_err(|e| with_context(e, "writing the mapping's uid_map"))?;
        std::fs::write(format!("/proc/{pid}/gid_map"), &line)
            .map_err(|e| with_context(e, "writing the mapping's gid_map"))?;
        std::fs::File::open(format!("/proc/{pid}/ns/user"))
            .map(OwnedFd::from)
            .map_err(|e| with_context(e, "opening the mapping's namespace"))
    })();
    drop(release_tx);
    drop(release_rx);
    let _ = nix::sys::wait::waitpid(pid, None);
    opened
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn kernel_releases_are_read_as_distributions_write_them() {
        assert_eq!(kernel_version("6.1.0-28-amd64"), (6, 1));
        assert_eq!(kernel_version("6.18.44-fc-v1300"), (6, 18));
        assert_eq!(kernel_version("5.4.0"), (5, 4));
        assert_eq!(kernel_version("weird"), (0, 0));
    }

    /// The tree shows its owners in the jail's range, ids outside the
    /// image's range show as no one's, and an overlay on top copies a file
    /// up with the jail's owner, never the image's.
    #[test]
    fn an_image_tree_shows_its_owners_in_the_jails_range_and_copies_up_in_it() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: idmapped mounts need root");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        if let Some(why) = unsupported(dir.path()) {
            eprintln!("skipped: {why}");
            return;
        }
        let shift = Shift { from: 2_000_000_000, to: 2_000_065_536, count: 65_536 };
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("etc")).expect("mkdir");
        for (name, owner) in [("etc/hostname", shift.from), ("etc/users", shift.from + 1000), ("etc/host", 0)] {
            std::fs::write(tree.join(name), "x\n").expect("write");
            std::os::unix::fs::chown(tree.join(name), Some(owner), Some(owner)).expect("chown");
        }
        std::os::unix::fs::chown(tree.join("etc"), Some(shift.from), Some(shift.from)).expect("chown");
        std::os::unix::fs::chown(&tree, Some(shift.from), Some(shift.from)).expect("chown");
        let base = dir.path().to_path_buf();
        // A thread with a mount namespace of its own: nothing reaches the
        // host's, and the namespace ends with the thread.
        let seen = std::thread::spawn(move || -> Result<Vec<u32>, String> {
            use nix::mount::{MsFlags, mount};
            use nix::sched::{CloneFlags, unshare};
            unshare(CloneFlags::CLONE_FS | CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare: {e}"))?;
            mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
                .map_err(|e| format!("private: {e}"))?;
            let (lower, upper, work, merged) =
                (base.join("lower"), base.join("upper"), base.join("work"), base.join("merged"));
            for d in [&lower, &upper, &work, &merged] {
                std::fs::create_dir(d).map_err(|e| e.to_string())?;
            }
            std::os::unix::fs::chown(&upper, Some(shift.to), Some(shift.to)).map_err(|e| e.to_string())?;
            mount_shifted(&tree, &lower, shift).map_err(|e| e.to_string())?;
            let options =
                format!("lowerdir={},upperdir={},workdir={}", lower.display(), upper.display(), work.display());
            mount(Some("test"), &merged, Some("overlay"), MsFlags::empty(), Some(options.as_str()))
                .map_err(|e| format!("overlay: {e}"))?;
            let mut append = std::fs::OpenOptions::new()
                .append(true)
                .open(merged.join("etc/hostname"))
                .map_err(|e| e.to_string())?;
            std::io::Write::write_all(&mut append, b"y\n").map_err(|e| e.to_string())?;
            let uid = |p: &Path| std::fs::metadata(p).map(|m| m.uid()).map_err(|e| e.to_string());
            let seen = vec![
                uid(&lower.join("etc/hostname"))?,
                uid(&lower.join("etc/users"))?,
                uid(&lower.join("etc/host"))?,
                uid(&upper.join("etc/hostname"))?,
                uid(&tree.join("etc/hostname"))?,
            ];
            nix::mount::umount2(&merged, nix::mount::MntFlags::MNT_DETACH).map_err(|e| e.to_string())?;
            nix::mount::umount2(&lower, nix::mount::MntFlags::MNT_DETACH).map_err(|e| e.to_string())?;
            Ok(seen)
        })
        .join()
        .expect("the thread")
        .expect("mounted");
        assert_eq!(
            seen,
            vec![shift.to, shift.to + 1000, 65_534, shift.to, shift.from],
            "the shifted tree, a file outside its range, the copy-up, the image itself untouched"
        );
    }
}
