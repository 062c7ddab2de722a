//! The capabilities a jail's processes may hold.
//!
//! Sandbox root is root in the sandbox's user namespace, which owns the
//! sandbox's network, mount and other namespaces: with every capability it
//! could configure nf_tables, open raw and packet sockets, mount, trace any
//! process. Before the jail's PID 1 execs the agent it drops from its
//! bounding set every capability not in [`KEPT`] and clears its inheritable
//! and ambient sets, so that nothing it or its descendants exec can hold
//! more (execve gives root the bounding set, and no file capability can add
//! to it).

use std::io;

/// Capabilities sandbox root keeps: Docker's default set less `CAP_NET_RAW`
/// (raw and packet sockets: forged frames) and `CAP_MKNOD` (device nodes,
/// which a user namespace cannot use anyway). Enough for the agent (running
/// commands as other users, writing and chowning files for them, signalling
/// their processes) and for what root does in a Debian system (apt, dpkg,
/// chown, a server on port 80).
pub const KEPT: &[(&str, u32)] = &[
    ("CAP_CHOWN", 0),
    ("CAP_DAC_OVERRIDE", 1),
    ("CAP_FOWNER", 3),
    ("CAP_FSETID", 4),
    ("CAP_KILL", 5),
    ("CAP_SETGID", 6),
    ("CAP_SETUID", 7),
    ("CAP_SETPCAP", 8),
    ("CAP_NET_BIND_SERVICE", 10),
    ("CAP_SYS_CHROOT", 18),
    ("CAP_AUDIT_WRITE", 29),
    ("CAP_SETFCAP", 31),
];

/// The highest capability number the kernel may know (the sets are 64 bits).
const LAST_POSSIBLE: u32 = 63;

/// The bit mask of [`KEPT`].
pub fn kept_mask() -> u64 {
    KEPT.iter().fold(0, |mask, (_, cap)| mask | (1u64 << cap))
}

/// Limits the calling thread (and what it execs) to [`KEPT`]: drops every
/// other capability from the bounding, permitted and effective sets and
/// clears the inheritable and ambient sets. Needs `CAP_SETPCAP`.
pub fn limit_to_kept() -> io::Result<()> {
    let kept = kept_mask();
    for cap in 0..=LAST_POSSIBLE {
        if kept & (1u64 << cap) != 0 {
            continue;
        }
        // SAFETY: prctl(2) with integer arguments only.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) } < 0 {
            let e = io::Error::last_os_error();
            // EINVAL: past the last capability this kernel has.
            if e.raw_os_error() == Some(libc::EINVAL) {
                break;
            }
            return Err(io::Error::new(e.kind(), format!("dropping capability {cap} from the bounding set: {e}")));
        }
    }
    // SAFETY: prctl(2) with integer arguments only.
    if unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) } < 0 {
        let e = io::Error::last_os_error();
        // EINVAL: a kernel without ambient capabilities (before 4.3).
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(io::Error::new(e.kind(), format!("clearing the ambient capabilities: {e}")));
        }
    }
    let mut sets = get()?;
    sets.permitted &= kept;
    sets.effective &= kept;
    sets.inheritable = 0;
    set(sets)
}

/// A thread's capability sets, as bit masks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sets {
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
}

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct Header {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`; version 3 uses two of them (low and
/// high 32 bits).
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const VERSION_3: u32 = 0x2008_0522;

fn split(mask: u64) -> [u32; 2] {
    [u32::try_from(mask & 0xffff_ffff).unwrap_or(0), u32::try_from(mask >> 32).unwrap_or(0)]
}

fn join(low: u32, high: u32) -> u64 {
    u64::from(low) | (u64::from(high) << 32)
}

/// The calling thread's capability sets.
pub fn get() -> io::Result<Sets> {
    let mut header = Header { version: VERSION_3, pid: 0 };
    let mut data = [Data::default(); 2];
    // SAFETY: capget(2) writes two `Data` records for version 3, which is
    // what `data` holds; both structs have the kernel's layout.
    if unsafe { libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Sets {
        effective: join(data[0].effective, data[1].effective),
        permitted: join(data[0].permitted, data[1].permitted),
        inheritable: join(data[0].inheritable, data[1].inheritable),
    })
}

fn set(sets: Sets) -> io::Result<()> {
    let mut header = Header { version: VERSION_3, pid: 0 };
    let (e, p, i) = (split(sets.effective), split(sets.permitted), split(sets.inheritable));
    let data = [
        Data { effective: e[0], permitted: p[0], inheritable: i[0] },
        Data { effective: e[1], permitted: p[1], inheritable: i[1] },
    ];
    // SAFETY: capset(2) reads two `Data` records for version 3, which is
    // what `data` holds; both structs have the kernel's layout.
    if unsafe { libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) } < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("setting the capability sets: {e}")));
    }
    Ok(())
}

/// The calling thread's bounding set, from `/proc/thread-self/status`.
pub fn bounding() -> io::Result<u64> {
    let status = std::fs::read_to_string("/proc/thread-self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .ok_or_else(|| io::Error::other("no CapBnd line in /proc/thread-self/status"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_kept_capabilities_survive() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: dropping from the bounding set needs CAP_SETPCAP (run as root)");
            return;
        }
        // On a thread of its own: capabilities are per thread.
        let (before, after, sets) = std::thread::spawn(|| {
            let before = bounding().expect("CapBnd");
            limit_to_kept().expect("limits");
            (before, bounding().expect("CapBnd"), get().expect("capget"))
        })
        .join()
        .expect("the thread's checks pass");
        assert_eq!(after, before & kept_mask());
        assert_eq!(sets.permitted & !kept_mask(), 0);
        assert_eq!(sets.effective & !kept_mask(), 0);
        assert_eq!(sets.inheritable, 0);
        // CAP_NET_ADMIN, CAP_NET_RAW, CAP_SYS_PTRACE, CAP_SYS_ADMIN.
        for dropped in [12, 13, 19, 21] {
            assert_eq!(after & (1u64 << dropped), 0, "capability {dropped} is dropped");
        }
    }

    #[test]
    fn the_mask_holds_docker_defaults_without_net_raw() {
        let mask = kept_mask();
        assert_eq!(mask.count_ones() as usize, KEPT.len());
        assert_eq!(mask & (1 << 13), 0, "CAP_NET_RAW");
        assert_ne!(mask & (1 << 7), 0, "CAP_SETUID");
        assert_eq!(split(0x1_0000_0002), [2, 1]);
        assert_eq!(join(2, 1), 0x1_0000_0002);
    }
}
