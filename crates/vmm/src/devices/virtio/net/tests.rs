//! The net device driven by an in-memory guest driver, with a socketpair
//! standing in for passt.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::passt::{BUFFER_BYTES, MAX_FRAME};
use super::*;
use crate::devices::IrqLine;
use crate::devices::bus::BusDevice;
use crate::devices::virtio::MmioTransport;
use crate::devices::virtio::testing::{Buf, F_NEXT, QueueDriver, guest_memory};

const MAC: [u8; 6] = [0x02, 0x6d, 0x6f, 0x61, 0x74, 0x01];
const RX_RINGS: u64 = 0x1_0000;
const TX_RINGS: u64 = 0x2_0000;
const RX_BUFS: u64 = 0x10_0000;
const TX_BUFS: u64 = 0x40_0000;
/// RX buffers are at most a page; TX slots hold the largest frame.
const SLOT: u64 = 0x1000;
const TX_SLOT: u64 = 0x1_1000;
/// What Linux posts without offloads: header plus a 1514-byte frame and a VLAN tag.
const LINUX_RX: u32 = 12 + 1518;

struct Rig {
    dev: Net,
    mem: GuestMemoryMmap,
    rx: QueueDriver,
    tx: QueueDriver,
    queues: Vec<Queue>,
    passt: UnixStream,
    tx_slot: u64,
}

fn rig() -> Rig {
    let (vmm_end, passt) = UnixStream::pair().expect("socketpair");
    let dev = Net::new(MAC, vmm_end).expect("device");
    let rx = QueueDriver::new(RX_RINGS, 256);
    let tx = QueueDriver::new(TX_RINGS, 256);
    let queues = vec![rx.queue(), tx.queue()];
    Rig { dev, mem: guest_memory(0x100_0000), rx, tx, queues, passt, tx_slot: 0 }
}

/// An IPv4 Ethernet frame of `len` bytes (at least 31) to 10.x.x.x, its
/// other bytes numbered from `seed`.
fn frame(len: usize, seed: u8) -> Vec<u8> {
    let mut f: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i.to_le_bytes()[0])).collect();
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    f[30] = 10;
    f
}

fn framed(frame: &[u8]) -> Vec<u8> {
    let mut out = u32::try_from(frame.len()).expect("small").to_be_bytes().to_vec();
    out.extend_from_slice(frame);
    out
}

impl Rig {
    /// Posts `n` RX buffers of `len` bytes.
    fn post_rx(&mut self, n: usize, len: u32) {
        for _ in 0..n {
            let slot = u64::from(self.rx.next_desc());
            self.rx.add_chain(&self.mem, &[Buf::write(RX_BUFS + slot * SLOT, len)]);
        }
    }
    /// Queues a frame on TX as Linux does (header, frame) without notifying.
    fn offer_tx(&mut self, frame: &[u8]) {
        let at = TX_BUFS + (self.tx_slot % 64) * TX_SLOT;
        self.tx_slot += 1;
        self.mem.write_slice(&[0u8; HDR_LEN], GuestAddress(at)).expect("header");
        self.mem.write_slice(frame, GuestAddress(at + 64)).expect("frame");
        let len = u32::try_from(frame.len()).expect("small");
        self.tx.add_chain(&self.mem, &[Buf::read(at, 12), Buf::read(at + 64, len)]);
    }
    fn notify(&mut self, queue: usize) -> bool {
        self.dev.process_queue(queue, &mut self.queues, &self.mem)
    }
    fn host(&mut self) -> bool {
        self.dev.process_host(Some(&mut self.queues), &self.mem)
    }
    /// Whether the device's descriptor is ready (what wakes the VMM loop).
    fn host_ready(&self, ms: i32) -> bool {
        let fd = self.dev.host_fd().expect("a host descriptor");
        let mut p = [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }];
        // SAFETY: one valid pollfd on a descriptor the device owns.
        unsafe { libc::poll(p.as_mut_ptr(), 1, ms) == 1 }
    }
    /// Pumps the host side until `want` RX buffers are used (or it stops).
    fn receive(&mut self, want: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut got = Vec::new();
        for _ in 0..1000 {
            if got.len() >= want || !self.host_ready(2000) {
                break;
            }
            self.host();
            got.extend(self.take_rx());
        }
        got
    }
    /// The RX buffers used since the last call: (header, frame).
    fn take_rx(&mut self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let used = self.rx.take_used(&self.mem);
        used.into_iter()
            .map(|(id, len)| {
                let mut bytes = vec![0u8; usize::try_from(len).expect("small")];
                self.mem.read_slice(&mut bytes, GuestAddress(RX_BUFS + u64::from(id) * SLOT)).expect("buffer");
                let frame = bytes.split_off(HDR_LEN.min(bytes.len()));
                (bytes, frame)
            })
            .collect()
    }
    /// Reads `n` frames as passt would.
    fn passt_read(&mut self, n: usize) -> Vec<Vec<u8>> {
        self.passt.set_read_timeout(Some(std::time::Duration::from_secs(5))).expect("timeout");
        (0..n)
            .map(|_| {
                let mut len = [0u8; 4];
                self.passt.read_exact(&mut len).expect("length");
                let mut frame = vec![0u8; usize::try_from(u32::from_be_bytes(len)).expect("small")];
                self.passt.read_exact(&mut frame).expect("frame");
                frame
            })
            .collect()
    }
    fn passt_has_nothing(&self) -> bool {
        self.passt.set_nonblocking(true).expect("nonblocking");
        let mut b = [0u8; 1];
        let nothing = matches!((&self.passt).read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        self.passt.set_nonblocking(false).expect("blocking");
        nothing
    }
}

#[test]
fn frames_cross_both_ways_with_their_headers_and_lengths() {
    let mut r = rig();
    let out = frame(1514, 1);
    r.offer_tx(&out);
    // A single-buffer chain (header and frame together) works as well.
    r.mem.write_slice(&[0u8; HDR_LEN], GuestAddress(TX_BUFS + 0x70_0000)).expect("header");
    r.mem.write_slice(&frame(60, 9), GuestAddress(TX_BUFS + 0x70_0000 + 12)).expect("frame");
    r.tx.add_chain(&r.mem, &[Buf::read(TX_BUFS + 0x70_0000, 72)]);
    assert!(r.notify(TX));
    assert_eq!(r.tx.take_used(&r.mem).len(), 2);
    assert_eq!(r.passt_read(2), vec![out, frame(60, 9)]);

    r.post_rx(4, LINUX_RX);
    r.passt.write_all(&[framed(&frame(42, 3)), framed(&frame(1514, 4))].concat()).expect("passt writes");
    let got = r.receive(2);
    assert_eq!(got.len(), 2);
    let mut want_header = [0u8; HDR_LEN];
    want_header[10] = 1; // num_buffers
    assert_eq!((got[0].0.as_slice(), &got[0].1), (&want_header[..], &frame(42, 3)));
    assert_eq!((got[1].0.as_slice(), &got[1].1), (&want_header[..], &frame(1514, 4)));
    assert!(!r.host_ready(0), "nothing left to do: the VMM loop sleeps");
}

#[test]
fn only_arp_and_ipv4_to_outside_addresses_but_link_local_reach_passt() {
    let mut r = rig();
    let mut arp = frame(42, 0);
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    let mut ipv6 = frame(80, 0);
    ipv6[12..14].copy_from_slice(&[0x86, 0xdd]);
    let mut vlan = frame(80, 0);
    vlan[12..14].copy_from_slice(&[0x81, 0x00]);
    let to = |first: u8| {
        let mut f = frame(60, 0);
        f[30] = first;
        f
    };
    // The cloud's metadata service, 169.254.169.254, and link-local beside it.
    let mut metadata = to(169);
    metadata[31] = 254;
    let mut near = to(169);
    near[31] = 253;
    let mut alibaba = to(100);
    alibaba[31..34].copy_from_slice(&[100, 100, 200]);
    for f in [ipv6, vlan, to(127), to(0), metadata, alibaba, frame(60, 0)[..13].to_vec()] {
        r.offer_tx(&f);
    }
    r.offer_tx(&arp);
    r.offer_tx(&to(192));
    r.offer_tx(&near);
    r.notify(TX);
    assert_eq!(r.tx.take_used(&r.mem).len(), 10, "every buffer is returned");
    assert_eq!(r.passt_read(3), vec![arp, to(192), near]);
    assert!(r.passt_has_nothing());
    assert_eq!(r.dev.dropped().1, 7);
}

#[test]
fn the_mac_address_is_in_configuration_space() {
    let r = rig();
    let mut mac = [0u8; 6];
    r.dev.read_config(0, &mut mac);
    assert_eq!(mac, MAC);
    let mut status = [0u8; 2];
    r.dev.read_config(6, &mut status);
    assert_eq!(status, [1, 0]);
    assert_eq!(r.dev.features(), F_MAC);
    assert_eq!(r.dev.device_type(), 1);
}

#[test]
fn a_guest_posting_no_rx_buffers_leaves_frames_in_the_socket() {
    let mut r = rig();
    r.passt.set_nonblocking(true).expect("nonblocking");
    let one = framed(&frame(1514, 7));
    let mut sent = 0usize;
    let mut rounds = 0;
    // passt writes until its socket is full, while the device reads as far
    // as its buffer goes; then the socket stays full.
    loop {
        match r.passt.write(&one) {
            Ok(n) if n == one.len() => sent += 1,
            Ok(_) => panic!("a partial write would desynchronize this test; use smaller frames"),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if !r.host_ready(0) {
                    break;
                }
                r.host();
                rounds += 1;
                assert!(rounds < 10_000, "the device keeps reading without buffers to fill");
            }
            Err(e) => panic!("passt's write: {e}"),
        }
    }
    assert!(sent * one.len() > BUFFER_BYTES, "more was sent than the device buffers");
    assert!(r.rx.take_used(&r.mem).is_empty());
    // The guest posts buffers: everything arrives, in order.
    r.passt.set_nonblocking(false).expect("blocking");
    let mut got = 0;
    while got < sent {
        r.post_rx(64, LINUX_RX);
        assert!(r.notify(RX), "buffers posted after frames waited are filled at once");
        for (_, f) in r.take_rx() {
            assert_eq!(f, frame(1514, 7));
            got += 1;
        }
        while got < sent && r.host_ready(0) && r.host() {
            got += r.take_rx().len();
        }
    }
    assert_eq!(got, sent);
}

#[test]
fn a_stalled_passt_holds_the_guests_tx_buffers_until_it_reads() {
    let mut r = rig();
    let big = frame(MAX_FRAME, 5);
    let count = 40;
    let mut returned = 0;
    for _ in 0..count {
        r.offer_tx(&big);
        r.notify(TX);
        returned += r.tx.take_used(&r.mem).len();
    }
    assert!(returned < count, "with nobody reading, TX buffers wait in their queue ({returned} of {count})");
    assert!(r.dev.link().tx_pending() <= BUFFER_BYTES);
    // passt reads: the device, woken by its descriptor, sends the rest.
    let reader = std::thread::spawn({
        let mut passt = r.passt.try_clone().expect("clone");
        move || {
            let mut frames = Vec::new();
            for _ in 0..count {
                let mut len = [0u8; 4];
                passt.read_exact(&mut len).expect("length");
                let mut f = vec![0u8; usize::try_from(u32::from_be_bytes(len)).expect("small")];
                passt.read_exact(&mut f).expect("frame");
                frames.push(f);
            }
            frames
        }
    });
    while returned < count {
        assert!(
            r.host_ready(5000),
            "the device waits for passt to take its bytes: {returned} returned, {} pending",
            r.dev.link().tx_pending()
        );
        r.host();
        returned += r.tx.take_used(&r.mem).len();
    }
    while r.dev.link().tx_pending() > 0 {
        assert!(r.host_ready(5000));
        r.host();
    }
    let frames = reader.join().expect("reader");
    assert!(frames.iter().all(|f| *f == big), "every frame arrives whole, in order");
}

#[test]
fn malformed_tx_chains_are_returned_and_dropped() {
    let mut r = rig();
    // Outside guest memory.
    r.tx.add_chain(&r.mem, &[Buf::read(1 << 40, 100)]);
    // A header and nothing else.
    r.tx.add_chain(&r.mem, &[Buf::read(TX_BUFS, 12)]);
    // Larger than any frame.
    r.tx.add_chain(&r.mem, &[Buf::read(TX_BUFS, 12), Buf::read(TX_BUFS + 0x1000, 70_000)]);
    // Length that wraps a u32 sum.
    r.tx.add_chain(&r.mem, &[Buf::read(TX_BUFS, u32::MAX), Buf::read(TX_BUFS, u32::MAX)]);
    assert!(r.notify(TX));
    // A descriptor chained to itself: the chain ends at the queue's size.
    let head = r.tx.next_desc();
    r.tx.write_desc(&r.mem, head, TX_BUFS, 64, F_NEXT, head);
    r.tx.publish(&r.mem, head);
    r.notify(TX);
    // And an RX chain looping the same way is returned empty.
    let head = r.rx.next_desc();
    r.rx.write_desc(&r.mem, head, RX_BUFS, 64, F_NEXT | crate::devices::virtio::testing::F_WRITE, head);
    r.rx.publish(&r.mem, head);
    r.passt.write_all(&framed(&frame(60, 1))).expect("writes");
    assert_eq!(r.receive(1).first().map(|(h, f)| h.len() + f.len()), Some(0));
    let used = r.tx.take_used(&r.mem);
    assert_eq!(used.len(), 5, "{used:?}");
    assert!(used.iter().all(|(_, len)| *len == 0));
    assert!(r.passt_has_nothing(), "nothing malformed reaches passt");
    assert_eq!(r.dev.dropped().1, 5);
    // The device still works.
    r.offer_tx(&frame(100, 1));
    r.notify(TX);
    assert_eq!(r.passt_read(1), vec![frame(100, 1)]);
}

#[test]
fn hostile_or_small_rx_buffers_lose_no_memory_and_no_sync() {
    let mut r = rig();
    // Outside guest memory: returned empty, the frame waits.
    r.rx.add_chain(&r.mem, &[Buf::write(1 << 40, 2000)]);
    // Device-readable only: nothing to write into.
    r.rx.add_chain(&r.mem, &[Buf::read(RX_BUFS, 2000)]);
    // Room for the header but not the frame: the frame is dropped, the
    // buffer kept for the next (smaller) frame.
    let slot = u64::from(r.rx.next_desc());
    r.rx.add_chain(&r.mem, &[Buf::write(RX_BUFS + slot * SLOT, 100)]);
    r.passt.write_all(&[framed(&frame(1000, 1)), framed(&frame(50, 2))].concat()).expect("writes");
    let got = r.receive(3);
    let lens: Vec<usize> = got.iter().map(|(h, f)| h.len() + f.len()).collect();
    assert_eq!(lens, vec![0, 0, 62], "two empty returns, then the small frame");
    assert_eq!(got[2].1, frame(50, 2));
    assert_eq!(r.dev.dropped().0, 1);
    // A buffer in two parts, the header split across them.
    let slot = u64::from(r.rx.next_desc());
    let at = RX_BUFS + slot * SLOT;
    r.rx.add_chain(&r.mem, &[Buf::write(at, 5), Buf::write(at + 5, 2000)]);
    r.passt.write_all(&framed(&frame(300, 3))).expect("writes");
    let got = r.receive(1);
    assert_eq!(got[0].1, frame(300, 3));
}

#[test]
fn a_frame_length_past_the_limit_takes_the_link_down() {
    let mut r = rig();
    r.post_rx(2, LINUX_RX);
    r.passt.write_all(&u32::try_from(MAX_FRAME + 1).expect("small").to_be_bytes()).expect("writes");
    r.passt.write_all(&[0u8; 64]).expect("writes");
    assert!(r.host_ready(2000));
    assert!(!r.host());
    assert!(!r.dev.link().is_up());
    assert!(!r.host_ready(0), "a dead link is not polled");
    // The guest's frames are still taken (and dropped).
    r.offer_tx(&frame(64, 0));
    assert!(r.notify(TX));
    assert_eq!(r.tx.take_used(&r.mem).len(), 1);
}

#[test]
fn a_passt_that_hangs_up_leaves_a_quiet_link() {
    let mut r = rig();
    r.post_rx(2, LINUX_RX);
    // A partial frame, then the end.
    r.passt.write_all(&[0, 0, 5, 0, 1, 2]).expect("writes");
    drop(std::mem::replace(&mut r.passt, UnixStream::pair().expect("pair").0));
    assert!(r.host_ready(2000));
    r.host();
    assert!(!r.dev.link().is_up());
    assert!(r.rx.take_used(&r.mem).is_empty(), "no partial frame reaches the guest");
    assert!(!r.host_ready(0));
    for _ in 0..300 {
        r.offer_tx(&frame(1000, 0));
        r.notify(TX);
    }
    assert_eq!(r.tx.take_used(&r.mem).len(), 300, "TX never stalls on a link that is gone");
}

#[test]
fn a_reset_drops_whole_frames_and_keeps_the_stream_in_step() {
    let mut r = rig();
    let b = framed(&frame(900, 2));
    // Frame A whole, half of B: read by the device while no driver is there.
    r.passt.write_all(&[framed(&frame(500, 1)), b[..400].to_vec()].concat()).expect("writes");
    assert!(r.host_ready(2000));
    assert!(!r.dev.process_host(None, &r.mem), "no driver: nothing used");
    r.dev.reset();
    r.passt.write_all(&[&b[400..], &framed(&frame(70, 3))[..]].concat()).expect("writes");
    r.post_rx(4, LINUX_RX);
    let got = r.receive(2);
    let frames: Vec<Vec<u8>> = got.into_iter().map(|(_, f)| f).collect();
    assert_eq!(frames, vec![frame(900, 2), frame(70, 3)], "A was dropped by the reset, B and C are whole");
}

/// Through the transport: the driver's register writes, as the guest makes them.
struct Driver {
    dev: MmioTransport,
    mem: Arc<GuestMemoryMmap>,
    irq: EventFd,
    passt: UnixStream,
}

impl Driver {
    fn new() -> Self {
        let mem = Arc::new(guest_memory(0x100_0000));
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let (vmm_end, passt) = UnixStream::pair().expect("socketpair");
        let net = Net::new(MAC, vmm_end).expect("device");
        let line = IrqLine(irq.try_clone().expect("clone"));
        Self { dev: MmioTransport::new(Box::new(net), mem.clone(), line).expect("transport"), mem, irq, passt }
    }
    fn write(&mut self, offset: u64, value: u32) {
        self.dev.write(offset, &value.to_le_bytes());
        self.dev.process_notifications();
    }
    fn read(&mut self, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        self.dev.read(offset, &mut b);
        u32::from_le_bytes(b)
    }
    fn bring_up(&mut self, rx: &QueueDriver, tx: &QueueDriver) {
        use crate::devices::virtio::mmio::{STATUS_ACKNOWLEDGE, STATUS_DRIVER, STATUS_DRIVER_OK, STATUS_FEATURES_OK};
        self.write(0x70, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        self.write(0x24, 0);
        self.write(0x20, u32::try_from(F_MAC).expect("low"));
        self.write(0x24, 1);
        self.write(0x20, 1);
        self.write(0x70, STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK);
        assert_ne!(self.read(0x70) & STATUS_FEATURES_OK, 0, "F_MAC and VERSION_1 accepted");
        for (index, q) in [(0, rx), (1, tx)] {
            self.write(0x30, index);
            self.write(0x38, 256);
            let (desc, avail, used) = q.addresses();
            for (reg, addr) in [(0x80, desc), (0x90, avail), (0xa0, used)] {
                self.write(reg, u32::try_from(addr).expect("low"));
                self.write(reg + 4, 0);
            }
            self.write(0x44, 1);
        }
        self.write(0x70, STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK);
    }
}

#[test]
fn notifications_before_setup_and_after_reset_serve_nothing() {
    let mut d = Driver::new();
    let mut rx = QueueDriver::new(RX_RINGS, 256);
    let mut tx = QueueDriver::new(TX_RINGS, 256);
    rx.add_chain(&d.mem, &[Buf::write(RX_BUFS, LINUX_RX)]);
    d.mem.write_slice(&[&[0u8; 12][..], &frame(68, 0)].concat(), GuestAddress(TX_BUFS)).expect("frame");
    tx.add_chain(&d.mem, &[Buf::read(TX_BUFS, 80)]);
    d.passt.write_all(&framed(&frame(60, 1))).expect("writes");
    d.write(0x50, 0);
    d.write(0x50, 1);
    d.write(0x50, 9);
    d.dev.process_host();
    assert!(rx.take_used(&d.mem).is_empty() && tx.take_used(&d.mem).is_empty());
    assert!(d.irq.read().is_err(), "no interrupt before DRIVER_OK");
    // Set up, the waiting buffers are served on the next notification.
    d.bring_up(&rx, &tx);
    d.write(0x50, 1);
    assert_eq!(tx.take_used(&d.mem).len(), 1);
    assert_eq!(rx.take_used(&d.mem), vec![(0, 72)]);
    assert!(d.irq.read().is_ok());
    let mut got = [0u8; 72];
    d.passt.read_exact(&mut got).expect("the TX frame");
    assert_eq!(got[..4], 68u32.to_be_bytes());
    // Reset in the middle of traffic: nothing more is served.
    d.passt.write_all(&framed(&frame(60, 2))).expect("writes");
    d.write(0x70, 0);
    rx.add_chain(&d.mem, &[Buf::write(RX_BUFS, LINUX_RX)]);
    d.write(0x50, 0);
    d.dev.process_host();
    assert!(rx.take_used(&d.mem).is_empty());
    assert!(d.irq.read().is_err());
}

#[path = "real_passt_tests.rs"]
mod real_passt;
