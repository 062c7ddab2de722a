//! passt for a microVM with network `open`: one passt process per sandbox,
//! the other end of the VM's virtio-net device.
//!
//! passt (Debian package `passt`) translates the guest's Ethernet frames
//! into ordinary TCP, UDP and ICMP sockets of the host, so the guest gets
//! outbound NAT without any privilege on the host: no tap device, no
//! bridge, no firewall rule. moat-core connects the two with a socketpair:
//! passt gets one end (`--fd`), moat-vmm the other (`net.passt_fd`), so
//! there is no socket file to race for or to protect.
//!
//! The guest's addresses are fixed and given to both sides (passt's
//! `--address`/`--netmask`/`--gateway`, the guest's `moat.net=` on the
//! kernel command line), so nothing waits for DHCP; passt runs with
//! `--no-dhcp` to make that plain.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

/// The guest's address, its prefix, its gateway (passt) and its resolver
/// (passt's forwarder to the host's resolver); QEMU's user-mode network
/// uses the same, so they are what tools and people expect.
pub const GUEST_ADDRESS: &str = "10.0.2.15";
pub const GUEST_PREFIX: u8 = 24;
pub const GATEWAY: &str = "10.0.2.2";
pub const DNS: &str = "10.0.2.3";
/// The guest's MAC address (moat-vmm's default) and passt's own.
pub const GUEST_MAC: &str = "02:6d:6f:61:74:01";
pub const PASST_MAC: &str = "02:6d:6f:61:74:fe";

/// The descriptor number each child gets its end of the socketpair as.
pub const CHILD_FD: i32 = 100;

/// The uid and gid passt runs as when moat runs as root: passt drops root
/// by itself, to `nobody`, but a change of credentials after exec would
/// clear its parent-death signal; so it is started as `nobody` already.
const NOBODY: libc::uid_t = 65_534;

/// `moat.net=` for the guest's kernel command line (the agent's
/// `netconf` reads it).
pub fn guest_cmdline() -> String {
    format!("moat.net={GUEST_ADDRESS}/{GUEST_PREFIX},{GATEWAY},{DNS}")
}

/// The `passt` binary, if installed.
pub fn find_passt() -> Option<PathBuf> {
    crate::programs::find_program("passt")
}

/// passt's arguments: outbound only. No port of the host is forwarded into
/// the guest (`--tcp-ports none --udp-ports none`); the gateway address is
/// passt itself, not the host's loopback (`--no-map-gw`), so the guest
/// reaches no service the host serves on 127.0.0.1; DNS queries to [`DNS`]
/// go to the host's resolver. IPv4 only, like the guest's configuration.
pub fn args(host_has_default_route: bool) -> Vec<String> {
    let mut args: Vec<String> = [
        "--foreground",
        "--quiet",
        "--ipv4-only",
        "--no-dhcp",
        "--tcp-ports",
        "none",
        "--udp-ports",
        "none",
        "--no-map-gw",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    args.extend(["--fd".into(), CHILD_FD.to_string()]);
    args.extend(["--address".into(), GUEST_ADDRESS.into(), "--netmask".into(), GUEST_PREFIX.to_string()]);
    args.extend(["--gateway".into(), GATEWAY.into(), "--mac-addr".into(), PASST_MAC.into()]);
    args.extend(["--dns-forward".into(), DNS.into()]);
    if !host_has_default_route {
        // passt takes its template interface from the default route and
        // refuses to start without one; with every address given, loopback
        // serves as the template, and the guest reaches what the host
        // reaches: its own addresses and directly attached networks.
        args.extend(["--interface".into(), "lo".into()]);
    }
    args
}

/// Whether the host has an IPv4 default route (`/proc/net/route`).
pub fn host_has_default_route() -> bool {
    std::fs::read_to_string("/proc/net/route")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .any(|l| l.split_whitespace().nth(1) == Some("00000000"))
}

/// A running passt, killed when dropped.
#[derive(Debug)]
pub struct Passt {
    child: Child,
}

impl Passt {
    /// Starts `binary` with its stderr to `log`; returns it and the other
    /// end of its socket, for moat-vmm.
    pub fn start(binary: &Path, log: File) -> std::io::Result<(Self, OwnedFd)> {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
        let (vmm_end, passt_end) = socketpair(AddressFamily::Unix, SockType::Stream, None, SockFlag::SOCK_CLOEXEC)
            .map_err(std::io::Error::from)?;
        let mut command = Command::new(binary);
        command.env_clear().envs(crate::process::helper_env());
        command.args(args(host_has_default_route())).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        // Its own process group: a terminal's Ctrl-C reaches only the host
        // process, which then destroys the sandbox in order.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let fd = passt_end.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and makes
        // only async-signal-safe calls (dup2/fcntl, geteuid, setgroups,
        // setresgid, setresuid, signal, setrlimit, prctl).
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                inherit(fd, CHILD_FD)?;
                if libc::geteuid() == 0
                    && (libc::setgroups(0, std::ptr::null()) < 0
                        || libc::setresgid(NOBODY, NOBODY, NOBODY) < 0
                        || libc::setresuid(NOBODY, NOBODY, NOBODY) < 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                // What the guest's traffic makes it log stays bounded.
                moat_sys::fds::cap_file_writes(moat_sys::fds::HELPER_LOG_MAX)?;
                // Last, after any change of credentials (which clears it):
                // passt dies with the process that started it.
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(std::io::Error::from)
            });
        }
        let child = command.spawn()?;
        Ok((Self { child }, vmm_end))
    }

    /// passt's exit status, if it has ended (it should not before the VM).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// passt's pid.
    pub fn id(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Passt {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Makes `fd` the child's descriptor `target`, without close-on-exec. For
/// use between fork and exec only (async-signal-safe).
pub fn inherit(fd: i32, target: i32) -> std::io::Result<()> {
    // SAFETY: dup2 and fcntl on descriptors of this process; `target` is a
    // number nothing else in the child uses.
    let done = unsafe { if fd == target { libc::fcntl(fd, libc::F_SETFD, 0) } else { libc::dup2(fd, target) } };
    if done < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passt_forwards_nothing_inwards_and_maps_no_loopback() {
        let args = args(true);
        let joined = args.join(" ");
        for word in ["--tcp-ports none", "--udp-ports none", "--no-map-gw", "--fd 100", "--no-dhcp"] {
            assert!(joined.contains(word), "{joined}");
        }
        assert!(joined.contains(&format!("--address {GUEST_ADDRESS} --netmask {GUEST_PREFIX}")), "{joined}");
        assert!(!joined.contains("--interface"), "{joined}");
        assert!(super::args(false).join(" ").ends_with("--interface lo"));
        assert_eq!(guest_cmdline(), "moat.net=10.0.2.15/24,10.0.2.2,10.0.2.3");
    }

    /// passt started as moat starts it answers on its end of the
    /// socketpair (the guest's ARP request for its gateway gets passt's
    /// reply) and dies when dropped.
    #[test]
    #[ignore = "needs passt (Debian package passt); cargo xtask test provides it"]
    fn passt_answers_on_its_socketpair_and_ends_when_dropped() {
        use std::io::{Read, Write};
        let binary = find_passt().expect("passt is installed");
        let dir = tempfile::tempdir().expect("dir");
        let log = File::create(dir.path().join("passt.log")).expect("log");
        let (passt, vmm_end) = Passt::start(&binary, log).expect("starts");
        let pid = passt.id();
        let mut stream = std::os::unix::net::UnixStream::from(vmm_end);
        stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).expect("timeout");
        let mac = [0x02, 0x6d, 0x6f, 0x61, 0x74, 0x01];
        let mut arp = vec![0xff; 6];
        arp.extend_from_slice(&mac);
        arp.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
        arp.extend_from_slice(&mac);
        arp.extend_from_slice(&[10, 0, 2, 15, 0, 0, 0, 0, 0, 0, 10, 0, 2, 2]);
        let mut framed = u32::try_from(arp.len()).expect("small").to_be_bytes().to_vec();
        framed.extend_from_slice(&arp);
        stream.write_all(&framed).expect("passt reads");
        let reply = loop {
            let mut len = [0u8; 4];
            stream.read_exact(&mut len).unwrap_or_else(|e| {
                panic!("{e}: {}", std::fs::read_to_string(dir.path().join("passt.log")).unwrap_or_default())
            });
            let mut frame = vec![0u8; usize::try_from(u32::from_be_bytes(len)).expect("small")];
            stream.read_exact(&mut frame).expect("frame");
            if frame.get(12..14) == Some(&[0x08, 0x06]) {
                break frame;
            }
        };
        assert_eq!((&reply[20..22], &reply[28..32]), (&[0, 2][..], &[10, 0, 2, 2][..]), "the gateway answers");
        drop(passt);
        let gone = nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")), None);
        assert!(gone.is_err(), "passt is gone with its handle");
    }
}
