//! The vsock device and muxer driven by an in-memory guest driver, with
//! real Unix sockets on the host side.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use vm_memory::Bytes;

use super::muxer::{BUF_ALLOC, MAX_CONNECTIONS};
use super::packet::*;
use crate::devices::virtio::testing::{Buf, VsockGuest};

const CID: u64 = 7;

struct Rig {
    guest: VsockGuest,
    dir: tempfile::TempDir,
}

fn rig() -> Rig {
    let dir = tempfile::tempdir().expect("dir");
    let guest = VsockGuest::new(CID, &dir.path().join("v.sock"), 4096 + 44);
    Rig { guest, dir }
}

fn hdr(src_port: u32, dst_port: u32, op: u16) -> Header {
    Header {
        src_cid: CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        kind: TYPE_STREAM,
        op,
        buf_alloc: 1 << 20,
        ..Header::default()
    }
}

impl Rig {
    fn uds(&self) -> std::path::PathBuf {
        self.dir.path().join("v.sock")
    }
    /// Pumps until at least one packet arrives (or ~2 s pass).
    fn expect_packets(&mut self) -> Vec<(Header, Vec<u8>)> {
        for _ in 0..200 {
            self.guest.poll(10);
            let got = self.guest.recv();
            if !got.is_empty() {
                return got;
            }
        }
        panic!("no packet for the guest");
    }
    /// A host connection to guest port `port`, accepted by the guest.
    fn host_connect(&mut self, port: u32) -> (UnixStream, u32) {
        let mut host = UnixStream::connect(self.uds()).expect("connects");
        host.write_all(format!("CONNECT {port}\n").as_bytes()).expect("writes");
        let got = self.expect_packets();
        let (req, _) = got[0];
        assert_eq!((req.op, req.dst_port, req.src_cid, req.dst_cid), (OP_REQUEST, port, HOST_CID, CID));
        assert!(req.src_port >= 1 << 30);
        self.guest.send(hdr(port, req.src_port, OP_RESPONSE), &[]);
        let mut ok = [0u8; 16];
        let n = host.read(&mut ok).expect("OK line");
        assert_eq!(std::str::from_utf8(&ok[..n]).expect("utf8"), format!("OK {}\n", req.src_port));
        (host, req.src_port)
    }
}

#[test]
fn host_connections_reach_the_guest_and_carry_data_both_ways() {
    let mut r = rig();
    let (mut host, local) = r.host_connect(1024);
    host.write_all(b"hello").expect("writes");
    let got = r.expect_packets();
    assert_eq!((got[0].0.op, got[0].1.as_slice()), (OP_RW, &b"hello"[..]));
    assert_eq!((got[0].0.src_port, got[0].0.dst_port, got[0].0.buf_alloc), (local, 1024, BUF_ALLOC));
    r.guest.send(hdr(1024, local, OP_RW), b"world");
    let mut buf = [0u8; 5];
    host.read_exact(&mut buf).expect("reads");
    assert_eq!(&buf, b"world");
    // The guest closes: the host sees the end, the guest gets its RST.
    let mut close = hdr(1024, local, OP_SHUTDOWN);
    close.flags = SHUTDOWN_SEND | SHUTDOWN_RCV;
    r.guest.send(close, &[]);
    r.guest.kick_rx();
    let got = r.guest.recv();
    assert_eq!(got[0].0.op, OP_RST);
    assert_eq!(host.read(&mut buf).expect("end"), 0);
    assert_eq!(r.guest.dev.muxer().connections(), 0);
}

#[test]
fn what_a_guest_sent_before_it_closed_reaches_a_slow_host_whole() {
    let mut r = rig();
    let (mut host, local) = r.host_connect(1024);
    // More than the host socket buffers while the host does not read,
    // within the guest's credit; then the guest closes at once.
    let chunk: Vec<u8> = (0..=255u8).cycle().take(65536).collect();
    let mut sent = Vec::new();
    while sent.len() + chunk.len() <= BUF_ALLOC as usize {
        r.guest.send(hdr(1024, local, OP_RW), &chunk);
        sent.extend_from_slice(&chunk);
    }
    assert!(r.guest.dev.muxer().buffered() > 0, "the host socket filled up and the rest waits");
    let mut close = hdr(1024, local, OP_SHUTDOWN);
    close.flags = SHUTDOWN_SEND | SHUTDOWN_RCV;
    r.guest.send(close, &[]);
    // The host reads now: everything, then the end.
    host.set_nonblocking(true).expect("nonblocking");
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65536];
    for _ in 0..2000 {
        r.guest.poll(1);
        match host.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("reading: {e}"),
        }
    }
    assert_eq!(got.len(), sent.len(), "the host got all the guest sent before it closed");
    assert!(got == sent);
    r.guest.kick_rx();
    assert!(r.guest.recv().iter().any(|(h, _)| h.op == OP_RST), "the guest hears the end");
    assert_eq!(r.guest.dev.muxer().connections(), 0);
}

#[test]
fn a_refused_host_connection_is_closed() {
    let mut r = rig();
    let mut host = UnixStream::connect(r.uds()).expect("connects");
    host.write_all(b"CONNECT 9\n").expect("writes");
    let (req, _) = r.expect_packets()[0];
    r.guest.send(hdr(9, req.src_port, OP_RST), &[]);
    let mut buf = [0u8; 8];
    assert_eq!(host.read(&mut buf).expect("closed"), 0);
    // A bad CONNECT line closes the socket too.
    let mut bad = UnixStream::connect(r.uds()).expect("connects");
    bad.write_all(b"HELLO\n").expect("writes");
    r.guest.poll(100);
    bad.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
    assert_eq!(bad.read(&mut buf).expect("closed"), 0);
}

#[test]
fn guest_connections_go_to_the_port_socket_or_are_reset() {
    let mut r = rig();
    let listener = UnixListener::bind(format!("{}_5000", r.uds().display())).expect("binds");
    r.guest.send(hdr(1234, 5000, OP_REQUEST), &[]);
    r.guest.kick_rx();
    let got = r.guest.recv();
    assert_eq!((got[0].0.op, got[0].0.src_port, got[0].0.dst_port), (OP_RESPONSE, 5000, 1234));
    let (mut host, _) = listener.accept().expect("accepted");
    r.guest.send(hdr(1234, 5000, OP_RW), b"ping");
    let mut buf = [0u8; 4];
    host.read_exact(&mut buf).expect("reads");
    assert_eq!(&buf, b"ping");
    host.write_all(b"pong").expect("writes");
    let got = r.expect_packets();
    assert_eq!(got[0].1, b"pong");
    // The host closes: the guest hears SHUTDOWN.
    drop(host);
    let got = r.expect_packets();
    assert_eq!(got[0].0.op, OP_SHUTDOWN);
    // Nothing listens on 6000.
    r.guest.send(hdr(1235, 6000, OP_REQUEST), &[]);
    r.guest.kick_rx();
    assert_eq!(r.guest.recv()[0].0.op, OP_RST);
}

#[test]
fn a_stalled_host_reader_back_pressures_the_guest_and_overruns_are_reset() {
    let mut r = rig();
    let listener = UnixListener::bind(format!("{}_5001", r.uds().display())).expect("binds");
    r.guest.send(hdr(1, 5001, OP_REQUEST), &[]);
    let (host, _) = listener.accept().expect("accepted");
    r.guest.kick_rx();
    r.guest.recv();
    // A well-behaved guest: sends only within its credit.
    let chunk = vec![0x5au8; 65536];
    let (mut sent, mut peer_fwd) = (0u32, 0u32);
    let mut stalled = false;
    for _ in 0..200 {
        if sent.wrapping_sub(peer_fwd) + 65536 > BUF_ALLOC {
            // Out of credit: see whether the device freed anything.
            r.guest.poll(1);
            for (h, _) in r.guest.recv() {
                peer_fwd = h.fwd_cnt;
            }
            if sent.wrapping_sub(peer_fwd) + 65536 > BUF_ALLOC {
                stalled = true;
                break;
            }
            continue;
        }
        r.guest.send(hdr(1, 5001, OP_RW), &chunk);
        sent += 65536;
        r.guest.kick_rx();
        for (h, _) in r.guest.recv() {
            assert_ne!(h.op, OP_RST, "a guest within its credit is never reset");
            peer_fwd = h.fwd_cnt;
        }
    }
    assert!(stalled, "the guest ran out of credit while the host did not read");
    assert!(r.guest.dev.muxer().buffered() <= BUF_ALLOC as usize);
    // A guest that ignores its credit is reset rather than buffered for.
    for _ in 0..8 {
        r.guest.send(hdr(1, 5001, OP_RW), &chunk);
    }
    r.guest.kick_rx();
    assert!(r.guest.recv().iter().any(|(h, _)| h.op == OP_RST));
    assert_eq!(r.guest.dev.muxer().buffered(), 0);
    drop(host);
}

#[test]
fn the_host_is_read_only_as_far_as_the_guests_credit_goes() {
    let mut r = rig();
    let (mut host, local) = r.host_connect(1024);
    // The guest's RESPONSE advertised 1 MiB; now it says 8 KiB, none consumed.
    let mut small = hdr(1024, local, OP_CREDIT_UPDATE);
    small.buf_alloc = 8192;
    r.guest.send(small, &[]);
    host.set_nonblocking(true).expect("nonblocking");
    let mut written = 0;
    while written < 4 << 20 {
        match host.write(&[1u8; 65536]) {
            Ok(n) => written += n,
            Err(_) => break,
        }
    }
    let mut got = 0;
    for _ in 0..20 {
        r.guest.poll(5);
        got += r.guest.recv().iter().map(|(_, p)| p.len()).sum::<usize>();
    }
    assert_eq!(got, 8192, "exactly the credit");
    // The guest consumed it and says so: more comes.
    let mut update = small;
    update.fwd_cnt = 8192;
    r.guest.send(update, &[]);
    let more: usize = r.expect_packets().iter().map(|(_, p)| p.len()).sum();
    assert!(more > 0 && more <= 8192, "{more}");
}

#[test]
fn connections_beyond_the_limit_are_refused_cleanly() {
    let mut r = rig();
    let mut hosts = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        let mut s = UnixStream::connect(r.uds()).expect("connects");
        s.write_all(b"CONNECT 1024\n").expect("writes");
        hosts.push(s);
    }
    for _ in 0..5 {
        r.guest.poll(10);
        r.guest.recv();
    }
    assert_eq!(r.guest.dev.muxer().connections(), MAX_CONNECTIONS);
    let mut extra = UnixStream::connect(r.uds()).expect("the listener still accepts");
    r.guest.poll(50);
    extra.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
    let mut buf = [0u8; 4];
    assert_eq!(extra.read(&mut buf).expect("closed at once"), 0);
    // A guest request over the limit is reset.
    r.guest.send(hdr(77, 5000, OP_REQUEST), &[]);
    r.guest.kick_rx();
    assert!(r.guest.recv().iter().any(|(h, _)| h.op == OP_RST && h.dst_port == 77));
}

#[test]
fn hostile_packets_are_reset_or_dropped_never_followed() {
    let mut r = rig();
    let (mut host, local) = r.host_connect(1024);
    // A header shorter than 44 bytes, a buffer outside guest memory, a
    // zero-length chain: dropped.
    r.guest.mem.write_slice(&hdr(1024, local, OP_RW).to_bytes(), vm_memory::GuestAddress(0x300_0000)).expect("w");
    r.guest.send_raw(&[Buf::read(0x300_0000, 20)]);
    r.guest.send_raw(&[Buf::read(1 << 40, 44)]);
    r.guest.send_raw(&[Buf::read(0x300_0000, 0)]);
    // A length past the buffer: the connection is reset.
    let mut lying = hdr(1024, local, OP_RW).to_bytes();
    lying[24..28].copy_from_slice(&1_000_000u32.to_le_bytes());
    r.guest.mem.write_slice(&lying, vm_memory::GuestAddress(0x300_0000)).expect("w");
    r.guest.send_raw(&[Buf::read(0x300_0000, 44), Buf::read(0x300_1000, 16)]);
    r.guest.kick_rx();
    assert!(r.guest.recv().iter().any(|(h, _)| h.op == OP_RST && h.dst_port == 1024));
    let mut buf = [0u8; 4];
    host.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
    assert_eq!(host.read(&mut buf).expect("closed"), 0);
    // Wrong cids, a datagram type, an unknown op, data for no connection: RST.
    for bad in [
        Header { src_cid: 99, ..hdr(1, 2, OP_REQUEST) },
        Header { dst_cid: 5, ..hdr(1, 2, OP_REQUEST) },
        Header { kind: 2, ..hdr(1, 2, OP_REQUEST) },
        hdr(1, 2, OP_RW),
    ] {
        r.guest.send(bad, b"x");
        r.guest.kick_rx();
        let got = r.guest.recv();
        assert_eq!(got.len(), 1, "{bad:?}");
        assert_eq!((got[0].0.op, got[0].0.dst_port, got[0].0.dst_cid), (OP_RST, 1, CID));
    }
    // An RST for nothing is not answered.
    r.guest.send(hdr(1, 2, OP_RST), &[]);
    r.guest.kick_rx();
    assert!(r.guest.recv().is_empty());
}

#[test]
fn rx_buffers_too_small_or_outside_memory_are_returned_and_the_packet_kept() {
    let dir = tempfile::tempdir().expect("dir");
    let mut guest = VsockGuest::new(CID, &dir.path().join("v.sock"), 16);
    let mut host = UnixStream::connect(dir.path().join("v.sock")).expect("connects");
    host.write_all(b"CONNECT 1\n").expect("writes");
    guest.poll(100);
    // Every buffer was too small: returned empty, the REQUEST still waits.
    assert!(guest.recv_with(false).is_empty());
    assert_eq!(guest.dev.muxer().connections(), 1);
}

#[test]
fn a_device_reset_ends_every_connection() {
    use crate::devices::virtio::VirtioDevice;
    let mut r = rig();
    let (mut host, _) = r.host_connect(1024);
    r.guest.dev.reset();
    let mut buf = [0u8; 4];
    host.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
    assert_eq!(host.read(&mut buf).expect("closed"), 0);
    assert_eq!(r.guest.dev.muxer().connections(), 0);
}

#[test]
fn guest_connections_reach_only_the_listed_host_ports() {
    let mut r = rig();
    r.guest.dev.limit_host_ports(Some(vec![5000]));
    let listed = UnixListener::bind(format!("{}_5000", r.uds().display())).expect("binds");
    let unlisted = UnixListener::bind(format!("{}_6000", r.uds().display())).expect("binds");
    unlisted.set_nonblocking(true).expect("nonblocking");
    r.guest.send(hdr(1234, 6000, OP_REQUEST), &[]);
    r.guest.kick_rx();
    assert_eq!(r.guest.recv()[0].0.op, OP_RST, "an unlisted port is reset");
    assert!(unlisted.accept().is_err(), "without the host socket hearing of it");
    r.guest.send(hdr(1234, 5000, OP_REQUEST), &[]);
    r.guest.kick_rx();
    assert_eq!(r.guest.recv()[0].0.op, OP_RESPONSE);
    listed.accept().expect("a listed port is connected");
    // No port at all: every guest connection is reset.
    r.guest.dev.limit_host_ports(Some(Vec::new()));
    r.guest.send(hdr(1236, 5000, OP_REQUEST), &[]);
    r.guest.kick_rx();
    assert_eq!(r.guest.recv()[0].0.op, OP_RST);
}
