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
