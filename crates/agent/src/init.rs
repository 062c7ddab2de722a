//! Being PID 1: the machine setup an init owes its processes, and shutdown.
//!
//! In a microVM the agent is the first process the kernel starts; in a jail
//! it is the first process of a new pid namespace. Either way nothing else
//! mounts the pseudo file systems, brings up loopback or reaps orphans.

use std::path::Path;

use nix::mount::{MsFlags, mount};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::reaper::Reaper;

/// One pseudo file system an init mounts.
struct Mount {
    source: &'static str,
    target: &'static str,
    fstype: &'static str,
    flags: MsFlags,
    data: Option<&'static str>,
}

const MOUNTS: &[Mount] = &[
    Mount { source: "proc", target: "/proc", fstype: "proc", flags: nosuid_nodev_noexec(), data: None },
    Mount { source: "sysfs", target: "/sys", fstype: "sysfs", flags: nosuid_nodev_noexec(), data: None },
    Mount {
        source: "devtmpfs",
        target: "/dev",
        fstype: "devtmpfs",
        flags: MsFlags::MS_NOSUID,
        data: Some("mode=0755"),
    },
    Mount {
        source: "devpts",
        target: "/dev/pts",
        fstype: "devpts",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NOEXEC),
        data: Some("newinstance,ptmxmode=0666,mode=0620"),
    },
    // Sized in shares of the guest's memory, which their files take: half
    // of it at most together, so that files never leave the commands (and
    // the `rm` that would free them) without room. Unsized, each could
    // take half. (A jail's instead share its disk: `jail::prepare_root`.)
    Mount {
        source: "shm",
        target: "/dev/shm",
        fstype: "tmpfs",
        flags: nosuid_nodev(),
        data: Some("mode=1777,size=20%"),
    },
    Mount { source: "tmpfs", target: "/tmp", fstype: "tmpfs", flags: nosuid_nodev(), data: Some("mode=1777,size=25%") },
    Mount { source: "tmpfs", target: "/run", fstype: "tmpfs", flags: nosuid_nodev(), data: Some("mode=0755,size=5%") },
];

const fn nosuid_nodev() -> MsFlags {
    MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV)
}

const fn nosuid_nodev_noexec() -> MsFlags {
    nosuid_nodev().union(MsFlags::MS_NOEXEC)
}

/// Mounts the pseudo file systems, sets the hostname and brings up loopback.
/// Each step that fails is logged and skipped: a half-set-up machine that
/// answers is more useful than one that is dead.
pub fn setup(hostname: Option<&str>) {
    mount_all(MOUNTS);
    setup_network_and_name(hostname);
}

/// Mounts just /proc, /sys and /dev: what a boot needs before the root disk.
pub fn mount_basics() {
    mount_all(&MOUNTS[..3]);
}

fn mount_all(mounts: &[Mount]) {
    for m in mounts {
        if let Err(e) = std::fs::create_dir_all(m.target) {
            tracing::warn!(target = m.target, "cannot create mount point: {e}");
            continue;
        }
        match mount(Some(m.source), m.target, Some(m.fstype), m.flags, m.data) {
            Ok(()) => tracing::debug!(target = m.target, "mounted {}", m.fstype),
            // The kernel (CONFIG_DEVTMPFS_MOUNT) or whoever made the
            // namespace mounted it already.
            Err(nix::errno::Errno::EBUSY) => tracing::debug!(target = m.target, "already mounted"),
            Err(e) => tracing::warn!(target = m.target, "cannot mount {}: {e}", m.fstype),
        }
    }
}

fn setup_network_and_name(hostname: Option<&str>) {
    // Programs open /dev/ptmx; with a private devpts instance it must be the
    // instance's own ptmx.
    if Path::new("/dev/pts/ptmx").exists() {
        let _ = std::fs::remove_file("/dev/ptmx");
        if let Err(e) = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx") {
            tracing::warn!("cannot link /dev/ptmx: {e}");
        }
    }
    if let Some(name) = hostname
        && let Err(e) = nix::unistd::sethostname(name)
    {
        tracing::warn!("cannot set the hostname to {name:?}: {e}");
    }
    if let Err(e) = loopback_up() {
        tracing::warn!("cannot bring up loopback: {e}");
    }
}

/// Sets IFF_UP on `lo`. The kernel assigns 127.0.0.1 and ::1 by itself.
pub fn loopback_up() -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").or_else(|_| std::net::UdpSocket::bind("[::]:0"))?;
    // SAFETY: `ifreq` is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: the socket is open for the call; SIOCGIFFLAGS writes only into
    // `req`, which we own and which is large enough (it is an `ifreq`).
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS filled the `ifru_flags` member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    // IFF_UP is 1: it fits any integer type.
    #[allow(clippy::cast_possible_truncation)]
    let up = libc::IFF_UP as libc::c_short;
    req.ifr_ifru.ifru_flags = flags | up;
    // SAFETY: as above; SIOCSIFFLAGS only reads `req`.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Adds the routing rules "to 169.254.0.0/16 prohibit" and "to
/// fd00:ec2::254 prohibit" to this network namespace, ahead of every
/// table: the cloud's metadata service (169.254.169.254, and AWS's IPv6
/// address) hands whoever asks the host machine's credentials, and a jail
/// whose network is `open` (pasta) would otherwise reach it as the host
/// does. Rules, not routes: pasta copies the host's routes into the
/// namespace (a host route to the metadata address among them, on some
/// clouds), never its rules. Sandbox root has no `CAP_NET_ADMIN` to remove
/// them. IPv6 is best effort (a namespace may have none).
///
/// Written by hand (one `RTM_NEWRULE` each, `linux/fib_rules.h`): four
/// fixed messages do not need a netlink crate in the agent.
pub fn prohibit_link_local() -> std::io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // linux/fib_rules.h
    const FRA_DST: u16 = 1;
    const FRA_PRIORITY: u16 = 6;
    const FR_ACT_PROHIBIT: u8 = 8;
    // Ahead of the local (0), main (32766) and default (32767) tables'.
    const PRIORITY: u32 = 100;
    // SAFETY: socket(2) with constant arguments; the result is owned below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let rule = |family: u8, dst: &[u8], seq: u32| -> std::io::Result<()> {
        let attr = |kind: u16, value: &[u8]| {
            let mut a = Vec::new();
            a.extend_from_slice(&u16::try_from(4 + value.len()).unwrap_or(0).to_ne_bytes());
            a.extend_from_slice(&kind.to_ne_bytes());
            a.extend_from_slice(value);
            a.resize(a.len().next_multiple_of(4), 0);
            a
        };
        let dst_len: u8 = if dst.len() == 4 { 16 } else { 128 };
        // struct fib_rule_hdr: family, dst_len, src_len, tos, table,
        // res1, res2, action, flags (u32).
        let mut body = vec![family, dst_len, 0, 0, 0, 0, 0, FR_ACT_PROHIBIT, 0, 0, 0, 0];
        body.extend(attr(FRA_DST, dst));
        body.extend(attr(FRA_PRIORITY, &PRIORITY.to_ne_bytes()));
        let flags = libc::NLM_F_REQUEST | libc::NLM_F_ACK | libc::NLM_F_CREATE | libc::NLM_F_EXCL;
        let mut message = Vec::new();
        message.extend_from_slice(&u32::try_from(16 + body.len()).unwrap_or(0).to_ne_bytes());
        message.extend_from_slice(&libc::RTM_NEWRULE.to_ne_bytes());
        message.extend_from_slice(&u16::try_from(flags).unwrap_or(0).to_ne_bytes());
        message.extend_from_slice(&seq.to_ne_bytes());
        message.extend_from_slice(&0u32.to_ne_bytes());
        message.extend(body);
        // SAFETY: send(2) reads `message.len()` bytes of `message`.
        if unsafe { libc::send(socket.as_raw_fd(), message.as_ptr().cast(), message.len(), 0) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // The answer: a NLMSG_ERROR message whose error is 0 (the ack) or
        // the negated errno.
        let mut answer = [0u8; 256];
        // SAFETY: recv(2) writes at most `answer.len()` bytes into it.
        let got = unsafe { libc::recv(socket.as_raw_fd(), answer.as_mut_ptr().cast(), answer.len(), 0) };
        let got = usize::try_from(got).map_err(|_| std::io::Error::last_os_error())?;
        let kind = answer.get(4..6).map(|b| u16::from_ne_bytes([b[0], b[1]]));
        let error = answer.get(16..20).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
        match (got >= 20, kind, error) {
            (true, Some(k), Some(0)) if i32::from(k) == libc::NLMSG_ERROR => Ok(()),
            (true, Some(k), Some(e)) if i32::from(k) == libc::NLMSG_ERROR => Err(std::io::Error::from_raw_os_error(-e)),
            _ => Err(std::io::Error::other("an unexpected answer from the kernel's routing socket")),
        }
    };
    rule(u8::try_from(libc::AF_INET).unwrap_or(2), &[169, 254, 0, 0], 1)?;
    let aws = [0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54];
    let _ = rule(u8::try_from(libc::AF_INET6).unwrap_or(10), &aws, 2);
    Ok(())
}

/// Sends SIGTERM to every process group the agent started, waits up to
/// `grace` for them, then SIGKILLs what is left (and, as PID 1, everyone).
pub async fn stop_children(reaper: &Reaper, grace: std::time::Duration, pid1: bool) {
    let running = reaper.running();
    for pid in &running {
        let _ = kill(Pid::from_raw(-pid), Signal::SIGTERM);
    }
    reaper.all_ended(tokio::time::Instant::now() + grace).await;
    for pid in reaper.running() {
        let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
    }
    if pid1 {
        // kill(-1) from PID 1 reaches every other process in the namespace.
        let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    }
    reaper.reap();
}
