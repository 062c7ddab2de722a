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
    /// The lock: exclusive on the range, or shared on range 0 where jails
    /// share it; `None` where not even that could be had.
    _held: Option<File>,
    /// Range 0, shared by the jails of an image that cannot be idmapped.
    shared: bool,
}

/// Range `n`.
pub fn range(n: u32) -> Range {
    Range { start: JAIL_ID_BASE + n * JAIL_ID_COUNT, count: JAIL_ID_COUNT }
}

impl Lease {
    /// Lets the range go, unless a process on the host still runs as one
    /// of its ids (its jail's cgroups could not be emptied, or there were
    /// none, so nothing else says so): then the range is kept from every
    /// later jail for as long as this process lives, since the next jail
    /// of the range would share a uid with that process. Reads each
    /// process's `status`, which shows its ids whatever it made itself.
    pub fn release_if_unused(self) {
        // A shared range is others' too: nothing to keep it from.
        if self.shared {
            return;
        }
        // pasta, outside the jail's pid namespace, ends on the monitor's
        // end (its parent-death signal), a moment after: looked at again
        // for up to a second before the range is kept. A sleep in a loop:
        // there is no event for "no process has these ids".
        for _ in 0..10 {
            if !ids_in_use(self.range) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        self.retire();
    }

    fn retire(self) {
        tracing::warn!(
            first = self.range.start,
            "a jail's id range is kept from other jails: not every process of the jail is known to have ended"
        );
        if let Some(held) = self._held {
            RETIRED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(held);
        }
    }
}

/// Whether a process on the host runs with a real, effective, saved or
/// file-system uid in `range` (a zombie runs nothing, and is not counted).
fn ids_in_use(range: Range) -> bool {
    let ours = |id: &str| id.parse::<u32>().is_ok_and(|id| id >= range.start && id - range.start < range.count);
    let Ok(procs) = std::fs::read_dir("/proc") else { return true };
    procs.filter_map(Result::ok).any(|entry| {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        let field = |name: &str| status.lines().find_map(|line| line.strip_prefix(name)).map(str::trim_start);
        !field("State:").is_some_and(|state| state.starts_with('Z'))
            && field("Uid:").is_some_and(|ids| ids.split_whitespace().any(ours))
    })
}

/// The locks of retired ranges ([`Lease::retire`]).
static RETIRED: std::sync::Mutex<Vec<File>> = std::sync::Mutex::new(Vec::new());

/// Why root's jails cannot each have a range of their own on this host,
/// for an image's tree at `rootfs`; `None` when they can. Decided by the
/// kernel's release and the file system's type, then, once per image tree
/// and process, by making (and dropping) an idmapped mount of it: an LSM,
/// a container or an already idmapped mount may refuse what the two
/// promise.
pub fn shared_because(rootfs: &Path) -> Option<String> {
    if let Some(why) = moat_sys::idmap::unsupported(rootfs) {
        return Some(why);
    }
    static TRIED: std::sync::Mutex<Vec<(std::path::PathBuf, Option<String>)>> = std::sync::Mutex::new(Vec::new());
    let mut tried = TRIED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, why)) = tried.iter().find(|(path, _)| path == rootfs) {
        return why.clone();
    }
    let shift = moat_sys::idmap::Shift { from: JAIL_ID_BASE, to: range(1).start, count: JAIL_ID_COUNT };
    let why = moat_sys::idmap::try_shift(rootfs, shift)
        .err()
        .map(|e| format!("an idmapped mount of {} is refused here ({e})", rootfs.display()));
    tried.push((rootfs.to_path_buf(), why.clone()));
    why
}

/// The lowest range no jail on this host holds, for a jail of the image at
/// `rootfs`: range 0 for all where the image cannot be idmapped, shared
/// (a shared lock on range 0 keeps leases from it while such jails run).
/// Range 0 is the image's own and needs no idmapped mount: the trial
/// mount of [`shared_because`] is made only when another range is taken
/// (so a lone jail, as `moat run`'s, never pays for it). An error says
/// what stopped the lease.
pub fn lease(rootfs: &Path) -> Result<Lease, String> {
    if let Some(why) = moat_sys::idmap::unsupported(rootfs) {
        return Ok(shared(&why));
    }
    let dir = open_leases()?;
    for n in 0..RANGES {
        if let Some(file) = lock(&dir, n, libc::LOCK_EX)? {
            if n > 0
                && let Some(why) = shared_because(rootfs)
            {
                drop(file);
                return Ok(shared(&why));
            }
            return Ok(Lease { range: range(n), _held: Some(file), shared: false });
        }
    }
    Err(format!(
        "all {RANGES} host id ranges for root's jails are held by running sandboxes; remove some (`moat ls`, `moat \
         rm`) and try again"
    ))
}

/// Range 0, shared by every jail of an image that cannot be idmapped.
fn shared(why: &str) -> Lease {
    tracing::debug!("jails share one id range: {why}");
    // Best effort: without the directory, nothing else leases either.
    let held = match open_leases().and_then(|dir| lock(&dir, 0, libc::LOCK_SH)) {
        Ok(Some(held)) => Some(held),
        Ok(None) => {
            tracing::warn!(
                "this jail shares range 0 with a jail that leased it alone: the image here cannot be idmapped ({why})"
            );
            None
        }
        Err(e) => {
            tracing::warn!("jails share range 0, unmarked: {e}");
            None
        }
    };
    Lease { range: range(0), _held: held, shared: true }
}

/// Range `n`'s lock, taken (`how`: shared or exclusive) without waiting;
/// `None` when another holds it so.
fn lock(dir: &std::os::fd::OwnedFd, n: u32, how: i32) -> Result<Option<File>, String> {
    let file = nix::fcntl::openat(
        dir,
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
    if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } == 0 {
        return Ok(Some(file));
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(None)
    } else {
        Err(format!("cannot lock the id lease {LEASES}/{n}: {e}"))
    }
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
    fn a_range_a_process_runs_in_is_in_use() {
        let own = nix::unistd::geteuid().as_raw();
        assert!(ids_in_use(Range { start: own, count: 1 }), "this process runs as {own}");
        assert!(!ids_in_use(range(RANGES - 1)), "no process runs in the last range");
    }

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
