//! Root's jails each map a host id range of their own.
//!
//! The kernel counts some budgets per user, at every level of user
//! namespaces: inotify instances (128 by default) and watches, queued
//! signals, POSIX message queue bytes. A sandbox's user namespace is owned
//! by the host uid its root maps to, so jails sharing one range share those
//! budgets, and one sandbox could take them all: another's `tail -f`, file
//! watcher or timer would fail. So each of root's jails leases a range of
//! its own, [`JAIL_ID_COUNT`] ids from `JAIL_ID_BASE + n × JAIL_ID_COUNT`,
//! from every moat process on the host: a lease is a lock (`flock`) on
//! [`LEASES`]`/n`, held while the jail lives, released by the kernel when
//! its holder ends however it ends.
//!
//! The image's files stay owned from `JAIL_ID_BASE`, range 0; the jail's
//! monitor shows them in the leased range through an idmapped mount
//! (`moat_sys::idmap`). Where the data directory's file system cannot be
//! idmapped, every jail maps range 0, as before, and `moat doctor` says so.
//! Rootless jails map the user's subordinate range, which has room for one.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::hostuser::Range;
use crate::image::{JAIL_ID_BASE, JAIL_ID_COUNT};

/// Where leases are held: root's, on the host's run-time file system, so
/// that every data directory's moat shares one set.
pub const LEASES: &str = "/run/moat/jail-ids";

/// How many ranges root's jails may hold at once: all of them fit below
/// 2^31, which some programs take for the largest uid.
pub const RANGES: u32 = 2048;

/// A jail's host ids, held until dropped.
#[derive(Debug)]
pub struct Lease {
    pub range: Range,
    /// The lock: `None` where every jail maps range 0.
    _held: Option<File>,
}

/// Range `n`.
pub fn range(n: u32) -> Range {
    Range { start: JAIL_ID_BASE + n * JAIL_ID_COUNT, count: JAIL_ID_COUNT }
}

/// Why root's jails cannot each have a range of their own on this host,
/// for an image's tree at `rootfs`; `None` when they can.
pub fn shared_because(rootfs: &Path) -> Option<String> {
    moat_sys::idmap::unsupported(rootfs)
}

/// The lowest range no jail on this host holds, for a jail of the image at
/// `rootfs`: range 0 for all where the image cannot be idmapped (and
/// nothing to lock). An error says what stopped the lease.
pub fn lease(rootfs: &Path) -> Result<Lease, String> {
    if let Some(why) = shared_because(rootfs) {
        tracing::debug!("jails share one id range: {why}");
        return Ok(Lease { range: range(0), _held: None });
    }
    let dir = open_leases()?;
    for n in 0..RANGES {
        let file = nix::fcntl::openat(
            &dir,
            n.to_string().as_str(),
            nix::fcntl::OFlag::O_RDWR
                | nix::fcntl::OFlag::O_CREAT
                | nix::fcntl::OFlag::O_NOFOLLOW
                | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| format!("cannot open the id lease {LEASES}/{n}: {e}; check that {LEASES} holds files only"))?;
        let file = File::from(file);
        // SAFETY: flock(2) on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Lease { range: range(n), _held: Some(file) });
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(format!("cannot lock the id lease {LEASES}/{n}: {e}"));
        }
    }
    Err(format!(
        "all {RANGES} host id ranges for root's jails are held by running sandboxes; remove some (`moat ls`, `moat \
         rm`) and try again"
    ))
}

/// [`LEASES`], made root's and private if it is not there.
fn open_leases() -> Result<std::os::fd::OwnedFd, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let path = Path::new(LEASES);
    if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path) {
        return Err(format!("cannot create {LEASES}, where root's jails lease their host ids: {e}"));
    }
    let dir = nix::fcntl::open(
        path,
        nix::fcntl::OFlag::O_RDONLY
            | nix::fcntl::OFlag::O_DIRECTORY
            | nix::fcntl::OFlag::O_NOFOLLOW
            | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| format!("cannot open {LEASES}: {e}"))?;
    let meta = File::from(dir.try_clone().map_err(|e| format!("cannot open {LEASES}: {e}"))?)
        .metadata()
        .map_err(|e| format!("cannot stat {LEASES}: {e}"))?;
    // Whoever may write it could hold every lease, or swap one for a link.
    if meta.uid() != 0 || meta.mode() & 0o022 != 0 {
        return Err(format!(
            "{LEASES} is owned by uid {} with mode {:o}: it must be root's and writable by root alone; as root, \
             remove it and moat makes it anew",
            meta.uid(),
            meta.mode() & 0o7777
        ));
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_follow_one_another_below_two_to_the_thirty_first() {
        assert_eq!(range(0), Range { start: JAIL_ID_BASE, count: JAIL_ID_COUNT });
        assert_eq!(range(1).start, JAIL_ID_BASE + JAIL_ID_COUNT);
        let last = range(RANGES - 1);
        assert!(u64::from(last.start) + u64::from(last.count) <= 1 << 31, "{last:?}");
    }

    #[test]
    fn two_leases_held_at_once_are_two_ranges_and_a_released_one_is_taken_again() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: leases are root's");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        if shared_because(dir.path()).is_some() {
            // Then every jail maps range 0, with no lease.
            let lease = lease(dir.path()).expect("lease");
            assert_eq!(lease.range, range(0));
            return;
        }
        let first = lease(dir.path()).expect("first");
        let second = lease(dir.path()).expect("second");
        assert_ne!(first.range, second.range, "two live jails share a range");
        let taken = first.range;
        drop(first);
        // Leases go lowest first. Other moat processes on this host (the
        // gate runs several) may free lower ranges meanwhile, or take the
        // released one: lease until a range at or past it comes.
        let mut held = Vec::new();
        loop {
            let next = lease(dir.path()).expect("again");
            if next.range.start >= taken.start {
                assert!(
                    next.range == taken || lease_is_held(taken),
                    "range {taken:?} was released and is free, but the next lease was {:?}",
                    next.range
                );
                break;
            }
            held.push(next);
        }
        drop(second);
    }

    /// Whether some process holds the lease of `range`.
    fn lease_is_held(range: Range) -> bool {
        let n = (range.start - JAIL_ID_BASE) / JAIL_ID_COUNT;
        let file = File::open(format!("{LEASES}/{n}")).expect("the lease file");
        // SAFETY: flock(2) on a descriptor we own; released as it closes.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) != 0 }
    }
}
