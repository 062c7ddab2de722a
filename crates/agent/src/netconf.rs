//! A microVM's network interface, configured from the kernel command line.
//!
//! With network policy `open`, moat-core gives the VM a virtio-net device
//! served by passt on the host and puts `moat.net=ADDR/PREFIX,GATEWAY,DNS`
//! on the command line; passt is started with the same fixed addresses, so
//! nothing depends on DHCP. The agent (PID 1, before anything else runs)
//! sets the address on `eth0`, brings it up, adds the default route and
//! writes `/etc/resolv.conf`.
//!
//! This is done with the classic `SIOCSIF*` and `SIOCADDRT` ioctls on an
//! ordinary socket rather than netlink or iproute2: the image carries no
//! `ip` (and the initramfs nothing but the agent), the workspace has no
//! netlink crate, and four ioctls are the whole job for one IPv4 address
//! and one route.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

/// The interface the VM's only network device becomes.
pub const INTERFACE: &str = "eth0";
/// How long the interface may take to appear after its module loaded.
const APPEAR_TIMEOUT: Duration = Duration::from_secs(10);

/// `moat.net=ADDR/PREFIX,GATEWAY,DNS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConfig {
    pub address: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Ipv4Addr,
    pub dns: Ipv4Addr,
}

impl NetConfig {
    /// Parses the value of `moat.net=`; `None` when it is malformed.
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.split(',');
        let (address, prefix) = parts.next()?.split_once('/')?;
        let config = Self {
            address: address.parse().ok()?,
            prefix: prefix.parse().ok().filter(|p| (1..=30).contains(p))?,
            gateway: parts.next()?.parse().ok()?,
            dns: parts.next()?.parse().ok()?,
        };
        parts.next().is_none().then_some(config)
    }

    /// The netmask of the prefix.
    pub fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::MAX << (32 - u32::from(self.prefix)))
    }

    /// The command-line word that carries this configuration.
    pub fn to_cmdline(&self) -> String {
        format!("moat.net={}/{},{},{}", self.address, self.prefix, self.gateway, self.dns)
    }
}

/// Why the network could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(
        "The network interface {INTERFACE} did not appear within 10 s; does the VM have a virtio-net device and the \
         image the virtio_net module (rebuild it with `cargo xtask image --force`)?"
    )]
    NoInterface,
    #[error("Cannot {what} on {INTERFACE}")]
    Ioctl { what: &'static str, source: std::io::Error },
    #[error("Cannot write /etc/resolv.conf")]
    Resolver(#[source] std::io::Error),
}

/// Configures `eth0` as `config` says and names its resolver in
/// `/etc/resolv.conf` (of the root the agent runs in now).
pub fn configure(config: &NetConfig) -> Result<(), NetError> {
    let started = Instant::now();
    while !Path::new("/sys/class/net").join(INTERFACE).exists() {
        if started.elapsed() > APPEAR_TIMEOUT {
            return Err(NetError::NoInterface);
        }
        // Exception to "wait on events", as in `boot::wait_for_device`: a
        // microVM's boot only, bounded, while the kernel probes the device.
        std::thread::sleep(Duration::from_millis(5));
    }
    let socket = std::net::UdpSocket::bind("0.0.0.0:0")
        .map_err(|source| NetError::Ioctl { what: "open a socket to configure it", source })?;
    let fd = socket.as_raw_fd();
    let ioctl = |what: &'static str, request: libc::c_ulong, arg: *mut libc::c_void| {
        // SAFETY: `fd` is the open socket above; each caller passes a
        // pointer to a live `ifreq` or `rtentry` that the request reads
        // or writes within its size.
        if unsafe { libc::ioctl(fd, request, arg) } < 0 {
            return Err(NetError::Ioctl { what, source: std::io::Error::last_os_error() });
        }
        Ok(())
    };
    let mut req = ifreq(INTERFACE);
    req.ifr_ifru.ifru_addr = sockaddr(config.address);
    ioctl("set the address", libc::SIOCSIFADDR, (&raw mut req).cast())?;
    let mut req = ifreq(INTERFACE);
    req.ifr_ifru.ifru_netmask = sockaddr(config.netmask());
    ioctl("set the netmask", libc::SIOCSIFNETMASK, (&raw mut req).cast())?;
    let mut req = ifreq(INTERFACE);
    ioctl("read the flags", libc::SIOCGIFFLAGS, (&raw mut req).cast())?;
    // SAFETY: SIOCGIFFLAGS filled the `ifru_flags` member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    // IFF_UP is 1: it fits any integer type.
    #[allow(clippy::cast_possible_truncation)]
    let up = libc::IFF_UP as libc::c_short;
    req.ifr_ifru.ifru_flags = flags | up;
    ioctl("bring it up", libc::SIOCSIFFLAGS, (&raw mut req).cast())?;
    // SAFETY: `rtentry` is plain old data; all-zero is a valid value
    // (destination and genmask 0.0.0.0: the default route).
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    route.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
    route.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
    route.rt_gateway = sockaddr(config.gateway);
    route.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    ioctl("add the default route", libc::SIOCADDRT, (&raw mut route).cast())?;
    // A link left by the image (to a resolver daemon's file) is replaced.
    let _ = std::fs::remove_file("/etc/resolv.conf");
    std::fs::write("/etc/resolv.conf", format!("nameserver {}\n", config.dns)).map_err(NetError::Resolver)
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: `ifreq` is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    // The name leaves room for its NUL (the array is zeroed).
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
        *dst = src.cast_signed();
    }
    req
}

fn sockaddr(address: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::sa_family_t::try_from(libc::AF_INET).unwrap_or_default(),
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(address).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: `sockaddr_in` and `sockaddr` are both 16 bytes of plain old
    // data; the kernel reads an AF_INET `sockaddr` as a `sockaddr_in`.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_word_round_trips() {
        let config = NetConfig::parse("10.0.2.15/24,10.0.2.2,10.0.2.3").expect("parses");
        assert_eq!(config.address, Ipv4Addr::new(10, 0, 2, 15));
        assert_eq!(config.netmask(), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!((config.gateway, config.dns), (Ipv4Addr::new(10, 0, 2, 2), Ipv4Addr::new(10, 0, 2, 3)));
        assert_eq!(config.to_cmdline(), "moat.net=10.0.2.15/24,10.0.2.2,10.0.2.3");
        for bad in ["", "10.0.2.15", "10.0.2.15/24", "10.0.2.15/33,1.1.1.1,1.1.1.1", "x/24,10.0.2.2,10.0.2.3"] {
            assert_eq!(NetConfig::parse(bad), None, "{bad}");
        }
        assert_eq!(NetConfig::parse("10.0.2.15/24,10.0.2.2,10.0.2.3,9.9.9.9"), None);
    }

    #[test]
    fn ifreq_names_are_nul_terminated() {
        let req = ifreq("a-very-long-interface-name");
        assert_eq!(req.ifr_name[libc::IFNAMSIZ - 1], 0);
        assert_eq!(ifreq("eth0").ifr_name[..5].iter().map(|c| c.cast_unsigned()).collect::<Vec<u8>>(), b"eth0\0");
    }
}
