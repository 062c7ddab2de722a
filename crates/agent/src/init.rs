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

/// The cloud providers' metadata services: each hands whoever asks it the
/// host machine's credentials (an IAM role, a service account's token).
/// (family, address, prefix length)
pub const METADATA_SERVICES: &[(i32, &[u8], u8)] = &[
    // Link-local, where 169.254.169.254 is (AWS, GCP, Azure, Oracle,
    // OpenStack, DigitalOcean) and AWS's other link-local services.
    (libc::AF_INET, &[169, 254, 0, 0], 16),
    // Alibaba Cloud's.
    (libc::AF_INET, &[100, 100, 100, 200], 32),
    // AWS's IPv6 metadata and EKS Pod Identity (fd00:ec2::254, ::23).
    (libc::AF_INET6, &[0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 64),
    // GCP's IPv6 metadata (fd20:ce::254).
    (libc::AF_INET6, &[0xfd, 0x20, 0, 0xce, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54], 128),
];

/// Adds a routing rule `to <address> prohibit` to this network namespace
/// for each of [`METADATA_SERVICES`] (`ip rule`, priority 100: before the
/// main table's rule, so whatever routes the namespace has, a connection
/// there fails with `EACCES` before a packet leaves). A jail whose network
/// is `open` (pasta) would otherwise reach them as the host does. Rules,
/// not routes: pasta copies the host's routes into the namespace (a host
/// route to a metadata address among them, on some clouds), never its
/// rules. Sandbox root has no `CAP_NET_ADMIN` to remove them. An IPv6 rule
/// is skipped where the namespace has no IPv6.
///
/// Written by hand (one `RTM_NEWRULE` each, `linux/fib_rules.h`): a few
/// fixed messages do not need a netlink crate in the agent.
pub fn prohibit_metadata_services() -> std::io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: socket(2) with constant arguments; the result is owned below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    for (seq, (family, address, prefix)) in (1u32..).zip(METADATA_SERVICES) {
        let message = rule_message(*family, address, *prefix, seq);
        // SAFETY: send(2) reads `message.len()` bytes of `message`.
        if unsafe { libc::send(socket.as_raw_fd(), message.as_ptr().cast(), message.len(), 0) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut answer = [0u8; 256];
        // SAFETY: recv(2) writes at most `answer.len()` bytes into it.
        let got = unsafe { libc::recv(socket.as_raw_fd(), answer.as_mut_ptr().cast(), answer.len(), 0) };
        let got = usize::try_from(got).map_err(|_| std::io::Error::last_os_error())?;
        match ack_error(&answer[..got.min(answer.len())]) {
            Some(0) => {}
            Some(libc::EAFNOSUPPORT) if *family == libc::AF_INET6 => {}
            Some(libc::EAFNOSUPPORT | libc::EOPNOTSUPP) => {
                return Err(std::io::Error::other(
                    "the kernel has no policy routing (CONFIG_IP_MULTIPLE_TABLES), which keeps an open sandbox from \
                     the cloud's metadata services; use network filtered, or a kernel with it",
                ));
            }
            Some(errno) => return Err(std::io::Error::from_raw_os_error(errno)),
            None => return Err(std::io::Error::other("an unexpected answer from the kernel's routing socket")),
        }
    }
    Ok(())
}

/// The `RTM_NEWRULE` request "to `address`/`prefix` prohibit", priority
/// 100: a `nlmsghdr` (16 bytes), a `fib_rule_hdr` (12) and the attributes
/// `FRA_DST` and `FRA_PRIORITY`, each padded to 4 bytes.
fn rule_message(family: i32, address: &[u8], prefix: u8, seq: u32) -> Vec<u8> {
    // linux/fib_rules.h
    const FRA_DST: u16 = 1;
    const FRA_PRIORITY: u16 = 6;
    const FR_ACT_PROHIBIT: u8 = 8;
    const PRIORITY: u32 = 100;
    let attr = |kind: u16, value: &[u8]| {
        let mut a = Vec::new();
        a.extend_from_slice(&u16::try_from(4 + value.len()).unwrap_or(0).to_ne_bytes());
        a.extend_from_slice(&kind.to_ne_bytes());
        a.extend_from_slice(value);
        a.resize(a.len().next_multiple_of(4), 0);
        a
    };
    // struct fib_rule_hdr: family, dst_len, src_len, tos, table, res1,
    // res2, action, flags (u32).
    let family = u8::try_from(family).unwrap_or(0);
    let mut body = vec![family, prefix, 0, 0, 0, 0, 0, FR_ACT_PROHIBIT, 0, 0, 0, 0];
    body.extend(attr(FRA_DST, address));
    body.extend(attr(FRA_PRIORITY, &PRIORITY.to_ne_bytes()));
    let flags = libc::NLM_F_REQUEST | libc::NLM_F_ACK | libc::NLM_F_CREATE | libc::NLM_F_EXCL;
    let mut message = Vec::new();
    message.extend_from_slice(&u32::try_from(16 + body.len()).unwrap_or(0).to_ne_bytes());
    message.extend_from_slice(&libc::RTM_NEWRULE.to_ne_bytes());
    message.extend_from_slice(&u16::try_from(flags).unwrap_or(0).to_ne_bytes());
    message.extend_from_slice(&seq.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    message.extend(body);
    message
}

/// The errno of a netlink acknowledgement (`NLMSG_ERROR`: 0 for success,
/// else the error, positive); `None` for anything else.
fn ack_error(answer: &[u8]) -> Option<i32> {
    let kind = u16::from_ne_bytes(answer.get(4..6)?.try_into().ok()?);
    let error = i32::from_ne_bytes(answer.get(16..20)?.try_into().ok()?);
    (i32::from(kind) == libc::NLMSG_ERROR).then(|| error.saturating_neg())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metadata_rule_is_the_message_the_kernel_reads() {
        let v4 = rule_message(libc::AF_INET, &[169, 254, 0, 0], 16, 7);
        // nlmsghdr + fib_rule_hdr + FRA_DST (4 + 4) + FRA_PRIORITY (4 + 4).
        assert_eq!(v4.len(), 16 + 12 + 8 + 8);
        assert_eq!(u32::from_ne_bytes(v4[0..4].try_into().expect("4")), 44, "the length covers it all");
        assert_eq!(u16::from_ne_bytes(v4[4..6].try_into().expect("2")), libc::RTM_NEWRULE);
        assert_eq!(u32::from_ne_bytes(v4[8..12].try_into().expect("4")), 7, "the sequence number");
        assert_eq!(&v4[16..28], &[2, 16, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0], "AF_INET, /16, prohibit");
        assert_eq!(&v4[28..36], &[8, 0, 1, 0, 169, 254, 0, 0][..], "FRA_DST");
        assert_eq!(&v4[36..40], &[8, 0, 6, 0][..], "FRA_PRIORITY");
        assert_eq!(u32::from_ne_bytes(v4[40..44].try_into().expect("4")), 100);
        let v6 = rule_message(libc::AF_INET6, METADATA_SERVICES[2].1, 64, 1);
        assert_eq!(v6.len(), 16 + 12 + 20 + 8);
        assert_eq!(v6[16..18], [10, 64]);
        assert_eq!(v6.len() % 4, 0, "attributes are padded");
    }

    #[test]
    fn acknowledgements_are_read_as_errors_or_success() {
        let ack = |kind: i32, error: i32| {
            let mut m = vec![0u8; 36];
            m[4..6].copy_from_slice(&u16::try_from(kind).expect("small").to_ne_bytes());
            m[16..20].copy_from_slice(&error.to_ne_bytes());
            m
        };
        assert_eq!(ack_error(&ack(libc::NLMSG_ERROR, 0)), Some(0));
        assert_eq!(ack_error(&ack(libc::NLMSG_ERROR, -libc::EEXIST)), Some(libc::EEXIST));
        assert_eq!(ack_error(&ack(libc::NLMSG_DONE, 0)), None, "not an acknowledgement");
        assert_eq!(ack_error(&[0u8; 12]), None, "too short");
    }
}
