//! An in-memory virtqueue driver: what a guest's virtio driver does to a
//! split queue (descriptor table, available ring, used ring), done on a
//! `GuestMemoryMmap` in this process. Unit tests, the benchmarks and the
//! fuzz target drive the device models with it, without KVM.

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Descriptor flags (virtio 1.2, §2.7.5).
pub const F_NEXT: u16 = 1;
/// The device writes this buffer.
pub const F_WRITE: u16 = 2;

/// A buffer of a chain: guest address, length, device-writable or not.
#[derive(Debug, Clone, Copy)]
pub struct Buf {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

impl Buf {
    /// A buffer the device reads.
    pub fn read(addr: u64, len: u32) -> Self {
        Self { addr, len, write: false }
    }
    /// A buffer the device writes.
    pub fn write(addr: u64, len: u32) -> Self {
        Self { addr, len, write: true }
    }
}

/// One split queue driven from the guest's side.
#[derive(Debug)]
pub struct QueueDriver {
    desc: u64,
    avail: u64,
    used: u64,
    size: u16,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
}

impl QueueDriver {
    /// A queue of `size` entries (a power of two) whose rings start at `base`
    /// and take `Self::footprint(size)` bytes.
    pub fn new(base: u64, size: u16) -> Self {
        let desc = base;
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size)).next_multiple_of(4);
        Self { desc, avail, used, size, next_desc: 0, avail_idx: 0, used_seen: 0 }
    }

    /// Bytes the rings of a queue of `size` entries take.
    pub fn footprint(size: u16) -> u64 {
        let s = u64::from(size);
        (16 * s + 6 + 2 * s).next_multiple_of(4) + 6 + 8 * s
    }

    /// The device's view: a ready `Queue` over these rings.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap_or_else(|_| panic!("{} is a valid queue size", self.size));
        let split = |a: u64| (Some((a & 0xffff_ffff) as u32), Some((a >> 32) as u32));
        let (lo, hi) = split(self.desc);
        q.set_desc_table_address(lo, hi);
        let (lo, hi) = split(self.avail);
        q.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(self.used);
        q.set_used_ring_address(lo, hi);
        q.set_ready(true);
        q
    }

    /// The descriptor the next chain starts at.
    pub fn next_desc(&self) -> u16 {
        self.next_desc % self.size
    }

    /// The guest addresses of the descriptor table, available ring and used ring.
    pub fn addresses(&self) -> (u64, u64, u64) {
        (self.desc, self.avail, self.used)
    }

    /// Writes descriptor `index` as given (a raw, possibly hostile, entry).
    pub fn write_desc(&self, mem: &GuestMemoryMmap, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = self.desc + 16 * u64::from(index % self.size);
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        let _ = mem.write_slice(&raw, GuestAddress(at));
    }

    /// Makes descriptor `head` available.
    pub fn publish(&mut self, mem: &GuestMemoryMmap, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
        let _ = mem.write_obj(head, GuestAddress(slot));
        self.avail_idx = self.avail_idx.wrapping_add(1);
        let _ = mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2));
    }

    /// Adds a chain of `bufs` (taking the next free descriptors) and makes
    /// it available; returns its head.
    pub fn add_chain(&mut self, mem: &GuestMemoryMmap, bufs: &[Buf]) -> u16 {
        let head = self.next_desc % self.size;
        for (i, b) in bufs.iter().enumerate() {
            let index = self.next_desc % self.size;
            let next = self.next_desc.wrapping_add(1) % self.size;
            let mut flags = if b.write { F_WRITE } else { 0 };
            if i + 1 < bufs.len() {
                flags |= F_NEXT;
            }
            self.write_desc(mem, index, b.addr, b.len, flags, next);
            self.next_desc = next;
        }
        self.publish(mem, head);
        head
    }

    /// The used entries (head, length) the device added since the last call.
    pub fn take_used(&mut self, mem: &GuestMemoryMmap) -> Vec<(u32, u32)> {
        let idx: u16 = mem.read_obj(GuestAddress(self.used + 2)).unwrap_or(self.used_seen);
        let mut out = Vec::new();
        while self.used_seen != idx {
            let at = self.used + 4 + 8 * u64::from(self.used_seen % self.size);
            let id: u32 = mem.read_obj(GuestAddress(at)).unwrap_or(u32::MAX);
            let len: u32 = mem.read_obj(GuestAddress(at + 4)).unwrap_or(u32::MAX);
            out.push((id, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }
}

/// Guest memory of `size` bytes from address 0.
pub fn guest_memory(size: usize) -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)])
        .unwrap_or_else(|e| panic!("{size} bytes of test memory: {e}"))
}

/// A guest's vsock driver over an in-memory `Vsock` device: RX buffers of
/// `rx_buf` bytes (header included) kept posted, TX packets sent one chain
/// each (header, payload), the way Linux's `vmw_vsock_virtio_transport` does.
#[derive(Debug)]
pub struct VsockGuest {
    pub dev: super::vsock::Vsock,
    pub mem: GuestMemoryMmap,
    pub cid: u64,
    rx: QueueDriver,
    tx: QueueDriver,
    queues: Vec<Queue>,
    rx_buf: u32,
    rx_posted: u16,
    tx_slot: u16,
}

const VSOCK_RINGS: u64 = 0x1_0000;
const VSOCK_RX_BUFS: u64 = 0x10_0000;
const VSOCK_TX_BUFS: u64 = 0x200_0000;
const VSOCK_QUEUE: u16 = 256;
const VSOCK_SLOT: u64 = 0x1_1000;

impl VsockGuest {
    /// A guest with context id `cid` whose device listens on `uds`.
    pub fn new(cid: u64, uds: &std::path::Path, rx_buf: u32) -> Self {
        assert!(u64::from(rx_buf) <= VSOCK_SLOT, "RX buffers are at most {VSOCK_SLOT} bytes");
        let dev = super::vsock::Vsock::new(cid, uds).unwrap_or_else(|e| panic!("vsock device on {uds:?}: {e}"));
        let step = QueueDriver::footprint(VSOCK_QUEUE).next_multiple_of(0x1000);
        let rx = QueueDriver::new(VSOCK_RINGS, VSOCK_QUEUE);
        let tx = QueueDriver::new(VSOCK_RINGS + step, VSOCK_QUEUE);
        let event = QueueDriver::new(VSOCK_RINGS + 2 * step, VSOCK_QUEUE);
        let queues = vec![rx.queue(), tx.queue(), event.queue()];
        let mem = guest_memory(0x400_0000 + 0x200_0000);
        let mut guest = Self { dev, mem, cid, rx, tx, queues, rx_buf, rx_posted: 0, tx_slot: 0 };
        guest.post_rx();
        guest
    }

    /// Posts RX buffers until the queue is full.
    pub fn post_rx(&mut self) {
        while self.rx_posted < VSOCK_QUEUE {
            // Descriptors are handed out in order, so slot = descriptor index.
            let slot = u64::from(self.rx.next_desc);
            self.rx.add_chain(&self.mem, &[Buf::write(VSOCK_RX_BUFS + slot * VSOCK_SLOT, self.rx_buf)]);
            self.rx_posted += 1;
        }
    }

    /// Sends one packet (the header's `len` set from `payload`).
    pub fn send(&mut self, mut hdr: super::vsock::packet::Header, payload: &[u8]) {
        use super::VirtioDevice;
        hdr.len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        let at = VSOCK_TX_BUFS + u64::from(self.tx_slot % VSOCK_QUEUE) * VSOCK_SLOT;
        self.tx_slot = self.tx_slot.wrapping_add(1);
        let _ = self.mem.write_slice(&hdr.to_bytes(), GuestAddress(at));
        let _ = self.mem.write_slice(payload, GuestAddress(at + 64));
        let mut bufs = vec![Buf::read(at, 44)];
        if !payload.is_empty() {
            bufs.push(Buf::read(at + 64, hdr.len));
        }
        self.tx.add_chain(&self.mem, &bufs);
        self.dev.process_queue(1, &mut self.queues, &self.mem);
        self.tx.take_used(&self.mem);
    }

    /// Sends a packet whose `len` payload bytes are whatever its TX slot
    /// holds (benchmarks: no copy on the guest's side).
    pub fn send_len(&mut self, mut hdr: super::vsock::packet::Header, len: u32) {
        use super::VirtioDevice;
        hdr.len = len;
        let at = VSOCK_TX_BUFS + u64::from(self.tx_slot % VSOCK_QUEUE) * VSOCK_SLOT;
        self.tx_slot = self.tx_slot.wrapping_add(1);
        let _ = self.mem.write_slice(&hdr.to_bytes(), GuestAddress(at));
        self.tx.add_chain(&self.mem, &[Buf::read(at, 44), Buf::read(at + 64, len)]);
        self.dev.process_queue(1, &mut self.queues, &self.mem);
        self.tx.take_used(&self.mem);
    }

    /// Takes the delivered packets without copying payloads: the payload
    /// bytes, and the headers of packets other than `OP_RW`. Buffers are
    /// posted again.
    pub fn drain(&mut self) -> (usize, Vec<super::vsock::packet::Header>) {
        let mut bytes = 0;
        let mut other = Vec::new();
        for (id, len) in self.rx.take_used(&self.mem) {
            self.rx_posted -= 1;
            let at = VSOCK_RX_BUFS + u64::from(id) * VSOCK_SLOT;
            let mut raw = [0u8; 44];
            if len < 44 || self.mem.read_slice(&mut raw, GuestAddress(at)).is_err() {
                continue;
            }
            let hdr = super::vsock::packet::Header::parse(&raw);
            if hdr.op == super::vsock::packet::OP_RW {
                bytes += usize::try_from(len - 44).unwrap_or(0);
            } else {
                other.push(hdr);
            }
        }
        self.post_rx();
        (bytes, other)
    }

    /// Sends a raw chain on TX (for hostile tests).
    pub fn send_raw(&mut self, bufs: &[Buf]) {
        use super::VirtioDevice;
        self.tx.add_chain(&self.mem, bufs);
        self.dev.process_queue(1, &mut self.queues, &self.mem);
        self.tx.take_used(&self.mem);
    }

    /// Lets the device act on host socket events (as the VMM loop does
    /// when its descriptor is ready) and on posted RX buffers.
    pub fn pump(&mut self) {
        use super::VirtioDevice;
        self.dev.process_host(Some(&mut self.queues), &self.mem);
    }

    /// Waits up to `ms` for the device's host descriptor, then pumps.
    pub fn poll(&mut self, ms: i32) {
        use super::VirtioDevice;
        if let Some(fd) = self.dev.host_fd() {
            let mut p = [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }];
            // SAFETY: one valid pollfd on a descriptor the device owns.
            unsafe { libc::poll(p.as_mut_ptr(), 1, ms) };
        }
        self.pump();
    }

    /// The packets the device delivered since the last call; their buffers
    /// are posted again when `repost`.
    pub fn recv_with(&mut self, repost: bool) -> Vec<(super::vsock::packet::Header, Vec<u8>)> {
        let mut out = Vec::new();
        for (id, len) in self.rx.take_used(&self.mem) {
            self.rx_posted -= 1;
            let at = VSOCK_RX_BUFS + u64::from(id) * VSOCK_SLOT;
            let mut raw = [0u8; 44];
            if len < 44 || self.mem.read_slice(&mut raw, GuestAddress(at)).is_err() {
                continue;
            }
            let hdr = super::vsock::packet::Header::parse(&raw);
            let n = usize::try_from(len - 44).unwrap_or(0);
            let mut payload = vec![0u8; n];
            let _ = self.mem.read_slice(&mut payload, GuestAddress(at + 44));
            out.push((hdr, payload));
        }
        if repost {
            self.post_rx();
        }
        out
    }

    /// `recv_with(true)`.
    pub fn recv(&mut self) -> Vec<(super::vsock::packet::Header, Vec<u8>)> {
        self.recv_with(true)
    }

    /// Lets the device deliver into freshly posted buffers.
    pub fn kick_rx(&mut self) {
        use super::VirtioDevice;
        self.dev.process_queue(0, &mut self.queues, &self.mem);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::VirtioDevice;

    /// What the fuzz target does, with a fixed pseudo-random sequence: each
    /// device meets garbage rings and buffers and must neither panic nor hang.
    #[test]
    fn devices_survive_random_queue_contents() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join("base"), vec![0x42u8; 1 << 20]).expect("base");
        let disk = super::super::block::CowDisk::open(&dir.path().join("base"), &dir.path().join("ov"), 256 << 10)
            .expect("overlay");
        let (passt_end, passt) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        let mut devices: Vec<Box<dyn VirtioDevice>> = vec![
            Box::new(super::super::block::Block::new(Box::new(disk), false, "t")),
            Box::new(super::super::vsock::Vsock::new(3, &dir.path().join("v.sock")).expect("vsock")),
            Box::new(super::super::rng::Rng::new().expect("rng")),
            Box::new(super::super::net::Net::new([2, 0, 0, 0, 0, 1], passt_end).expect("net")),
        ];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut passt_holder = Some(passt);
        let mem = guest_memory(64 * 1024);
        let mut page = vec![0u8; 64 * 1024];
        for round in 0..3000u64 {
            // Mostly small numbers, so that addresses, lengths and indices
            // land inside the guest often enough to matter.
            for chunk in page.chunks_mut(8) {
                let v = next();
                let v = if v % 4 == 0 { v } else { v % 0x1_0000 };
                chunk.copy_from_slice(&v.to_le_bytes()[..chunk.len()]);
            }
            mem.write_slice(&page, GuestAddress(0)).expect("inside");
            if round == 1500 {
                // passt goes away halfway.
                drop(passt_holder.take());
            }
            let device = &mut devices[usize::try_from(round % 4).expect("small")];
            let count = device.queue_max_sizes().len();
            let mut queues: Vec<_> = (0..count).map(|i| QueueDriver::new(0x1000 * i as u64, 16).queue()).collect();
            let index = usize::try_from(next() % count as u64).expect("small");
            device.process_queue(index, &mut queues, &mem);
            device.process_host(Some(&mut queues), &mem);
            if round % 97 == 0 {
                device.reset();
            }
        }
    }
}
