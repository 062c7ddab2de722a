//! The net device against the real passt (ignored unless `passt` is
//! installed; `cargo xtask test` provides it), started the way moat-core
//! starts it: on one end of a socketpair (`--fd`).

use super::*;

/// The real passt (`passt --fd`, the way moat-core starts it) on a rig.
struct RealPasst {
    rig: Rig,
    child: std::process::Child,
}

impl Drop for RealPasst {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const PASST_MAC: [u8; 6] = [0x02, 0x6d, 0x6f, 0x61, 0x74, 0xfe];

fn real_passt() -> RealPasst {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;

    let (vmm_end, passt_end) = UnixStream::pair().expect("socketpair");
    let fd = passt_end.as_raw_fd();
    let mut command = std::process::Command::new("passt");
    command
        .args(["--foreground", "--quiet", "--ipv4-only", "--fd", "3", "--address", "10.0.2.15"])
        .args(["--netmask", "24", "--gateway", "10.0.2.2", "--mac-addr", "02:6d:6f:61:74:fe"])
        .args(["--tcp-ports", "none", "--udp-ports", "none", "--no-map-gw"])
        .stdin(std::process::Stdio::null());
    // SAFETY: dup2 is async-signal-safe; descriptor 3 is free in the child
    // once dup2 replaces it.
    unsafe {
        command.pre_exec(move || if libc::dup2(fd, 3) < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) });
    }
    let child = command.spawn().expect("passt starts");
    drop(passt_end);
    let dev = Net::new(MAC, vmm_end).expect("device");
    let rx = QueueDriver::new(RX_RINGS, 256);
    let tx = QueueDriver::new(TX_RINGS, 256);
    let queues = vec![rx.queue(), tx.queue()];
    let (passt, _) = UnixStream::pair().expect("unused");
    let mut rig = Rig { dev, mem: guest_memory(0x100_0000), rx, tx, queues, passt, tx_slot: 0 };
    rig.post_rx(64, LINUX_RX);
    RealPasst { rig, child }
}

fn arp_request_for_gateway() -> Vec<u8> {
    let mut arp = vec![0xff; 6];
    arp.extend_from_slice(&MAC);
    arp.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    arp.extend_from_slice(&MAC);
    arp.extend_from_slice(&[10, 0, 2, 15, 0, 0, 0, 0, 0, 0, 10, 0, 2, 2]);
    arp
}

/// Against the real passt: the guest asks for its gateway's address and
/// passt answers, so the framing on the stream is passt's own.
#[test]
#[ignore = "needs passt (Debian package passt); cargo xtask test provides it"]
fn real_passt_answers_the_guests_arp_request_for_its_gateway() {
    let mut p = real_passt();
    let r = &mut p.rig;
    let arp = arp_request_for_gateway();
    let mut reply = None;
    for _ in 0..20 {
        r.offer_tx(&arp);
        r.notify(TX);
        reply = r.receive(1).into_iter().map(|(_, f)| f).find(|f| f.get(12..14) == Some(&[0x08, 0x06]));
        if reply.is_some() {
            break;
        }
    }
    let reply = reply.expect("passt answers ARP");
    assert_eq!(&reply[..6], &MAC, "to the guest");
    assert_eq!(&reply[20..22], &[0, 2], "an ARP reply");
    assert_eq!((&reply[22..28], &reply[28..32]), (&PASST_MAC[..], &[10, 0, 2, 2][..]), "the gateway is passt");
}

fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum = 0u32;
    for part in parts {
        for pair in part.chunks(2) {
            sum += u32::from(u16::from_be_bytes([pair[0], pair.get(1).copied().unwrap_or(0)]));
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).expect("folded")
}

/// An Ethernet frame with a TCP SYN from the guest to `dst`:`port`.
fn tcp_syn(dst: [u8; 4], port: u16) -> Vec<u8> {
    let src = [10, 0, 2, 15];
    let mut tcp = vec![0u8; 20];
    tcp[0..2].copy_from_slice(&40_000u16.to_be_bytes());
    tcp[2..4].copy_from_slice(&port.to_be_bytes());
    tcp[4..8].copy_from_slice(&1u32.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = 0x02; // SYN
    tcp[14..16].copy_from_slice(&64_240u16.to_be_bytes());
    let pseudo = [&src[..], &dst[..], &[0, 6, 0, 20]].concat();
    let sum = checksum(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&sum.to_be_bytes());
    let mut ip = vec![0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0];
    ip.extend_from_slice(&src);
    ip.extend_from_slice(&dst);
    let sum = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut frame = PASST_MAC.to_vec();
    frame.extend_from_slice(&MAC);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&tcp);
    frame
}

/// A guest's root can send any frame: a SYN crafted for 127.0.0.1 (which
/// the guest's own stack would never put on eth0) or for the gateway must
/// not become a connection to the host's loopback services, while a SYN
/// for one of the host's other addresses does reach it.
#[test]
#[ignore = "needs passt (Debian package passt); cargo xtask test provides it"]
fn real_passt_keeps_crafted_frames_away_from_the_hosts_loopback() {
    let mut p = real_passt();
    let r = &mut p.rig;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("address").port();
    r.offer_tx(&arp_request_for_gateway());
    r.notify(TX);
    r.receive(1);
    for dst in [[127, 0, 0, 1], [127, 1, 2, 3], [0, 0, 0, 0], [10, 0, 2, 2]] {
        for _ in 0..3 {
            r.offer_tx(&tcp_syn(dst, port));
            r.notify(TX);
        }
    }
    // Whatever passt does with them, it has done it once it answers a
    // later ARP request (it handles frames in order).
    for _ in 0..20 {
        r.offer_tx(&arp_request_for_gateway());
        r.notify(TX);
        if r.receive(1).iter().any(|(_, f)| f.get(12..14) == Some(&[0x08, 0x06])) {
            break;
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(listener.accept().is_err(), "a crafted frame reached a service on the host's loopback");
}
