//! virtio-blk driven by an in-memory virtqueue driver, including hostile ones.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::*;
use crate::devices::virtio::testing::{Buf, F_NEXT, F_WRITE, QueueDriver, guest_memory};

const RING: u64 = 0x1000;
const HDR: u64 = 0x10_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0x1f_0000;
const MEM: usize = 16 << 20;

struct Rig {
    dev: Block,
    mem: GuestMemoryMmap,
    drv: QueueDriver,
    queues: Vec<Queue>,
    _file: tempfile::NamedTempFile,
}

fn rig_with(disk: Box<dyn DiskBackend>, read_only: bool, file: tempfile::NamedTempFile) -> Rig {
    let mem = guest_memory(MEM);
    let drv = QueueDriver::new(RING, 256);
    let queues = vec![drv.queue()];
    Rig { dev: Block::new(disk, read_only, "moat-test-disk"), mem, drv, queues, _file: file }
}

fn rig(read_only: bool) -> Rig {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    let bytes: Vec<u8> = (0..1u32 << 20).map(|i| (i % 253) as u8).collect();
    std::fs::write(file.path(), bytes).expect("disk written");
    let disk = RawDisk::open(file.path(), read_only).expect("opens");
    rig_with(Box::new(disk), read_only, file)
}

impl Rig {
    fn header(&self, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(HDR)).expect("header");
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).expect("status");
    }
    /// Submits `bufs`, runs the device, returns (used length, status byte).
    fn run(&mut self, bufs: &[Buf]) -> Vec<(u32, u32)> {
        self.drv.add_chain(&self.mem, bufs);
        self.dev.process_queue(0, &mut self.queues, &self.mem);
        self.drv.take_used(&self.mem)
    }
    fn status(&self) -> u8 {
        self.mem.read_obj(GuestAddress(STATUS)).expect("status")
    }
    fn read(&mut self, sector: u64, len: u32) -> (u8, Vec<u8>) {
        self.header(T_IN, sector);
        let used = self.run(&[Buf::read(HDR, 16), Buf::write(DATA, len), Buf::write(STATUS, 1)]);
        assert_eq!(used.len(), 1);
        let mut out = vec![0u8; len as usize];
        self.mem.read_slice(&mut out, GuestAddress(DATA)).expect("data");
        (self.status(), out)
    }
    fn write(&mut self, sector: u64, data: &[u8]) -> u8 {
        self.header(T_OUT, sector);
        self.mem.write_slice(data, GuestAddress(DATA)).expect("data");
        let len = u32::try_from(data.len()).expect("small");
        let used = self.run(&[Buf::read(HDR, 16), Buf::read(DATA, len), Buf::write(STATUS, 1)]);
        assert_eq!(used, vec![(used[0].0, 1)], "only the status byte is written");
        self.status()
    }
}

fn pattern(at: usize, len: usize) -> Vec<u8> {
    (at..at + len).map(|i| (i % 253) as u8).collect()
}

#[test]
fn reads_writes_flushes_and_identifies() {
    let mut r = rig(false);
    let (status, data) = r.read(8, 4096);
    assert_eq!((status, data), (S_OK, pattern(4096, 4096)));
    assert_eq!(r.write(8, &[7u8; 1024]), S_OK);
    let (status, data) = r.read(7, 2048);
    assert_eq!(status, S_OK);
    assert_eq!(&data[..512], &pattern(3584, 512)[..]);
    assert_eq!(&data[512..1536], &[7u8; 1024][..]);
    r.header(T_FLUSH, 0);
    r.run(&[Buf::read(HDR, 16), Buf::write(STATUS, 1)]);
    assert_eq!(r.status(), S_OK);
    r.header(T_GET_ID, 0);
    let used = r.run(&[Buf::read(HDR, 16), Buf::write(DATA, 20), Buf::write(STATUS, 1)]);
    assert_eq!(used[0].1, 21);
    let mut id = [0u8; 20];
    r.mem.read_slice(&mut id, GuestAddress(DATA)).expect("id");
    assert_eq!(&id[..14], b"moat-test-disk");
    r.header(99, 0);
    r.run(&[Buf::read(HDR, 16), Buf::write(STATUS, 1)]);
    assert_eq!(r.status(), S_UNSUPP);
    let mut cap = [0u8; 8];
    r.dev.read_config(0, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), (1 << 20) / 512);
    assert_eq!(r.dev.features() & (F_RO | F_FLUSH), F_FLUSH);
}

#[test]
fn a_read_only_disk_refuses_writes() {
    let mut r = rig(true);
    assert_ne!(r.dev.features() & F_RO, 0);
    assert_eq!(r.write(0, &[1u8; 512]), S_IOERR);
    assert_eq!(r.read(0, 512), (S_OK, pattern(0, 512)));
}

#[test]
fn out_of_range_and_oversized_requests_fail() {
    let mut r = rig(false);
    assert_eq!(r.read((1 << 20) / 512, 512).0, S_IOERR, "past the end");
    assert_eq!(r.read((1 << 20) / 512 - 1, 1024).0, S_IOERR, "straddling the end");
    assert_eq!(r.read(u64::MAX / 2, 512).0, S_IOERR, "sector overflow");
    assert_eq!(r.read(0, 100).0, S_IOERR, "not whole sectors");
    assert_eq!(r.read(0, (MAX_REQUEST_BYTES + 512) as u32).0, S_IOERR, "too large");
}

#[test]
fn hostile_chains_fail_without_touching_memory_outside_the_guest() {
    let mut r = rig(false);
    // Data buffer outside guest memory: the chain cannot be mapped.
    r.header(T_IN, 0);
    let used = r.run(&[Buf::read(HDR, 16), Buf::write(1 << 40, 4096), Buf::write(STATUS, 1)]);
    assert_eq!(used[0].1, 0, "returned empty");
    // Header outside guest memory: an error status.
    let used = r.run(&[Buf::read(1 << 40, 16), Buf::write(STATUS, 1)]);
    assert_eq!((used[0].1, r.status()), (1, S_IOERR));
    // Misdirected: the header in a writable buffer.
    r.header(T_IN, 0);
    r.run(&[Buf::write(HDR, 16), Buf::write(STATUS, 1)]);
    assert_eq!(r.status(), S_IOERR);
    // A write whose data the device should write into.
    r.header(T_OUT, 0);
    r.run(&[Buf::read(HDR, 16), Buf::write(DATA, 512), Buf::write(STATUS, 1)]);
    assert_eq!(r.status(), S_IOERR);
    // A short header.
    r.header(T_IN, 0);
    r.run(&[Buf::read(HDR, 8), Buf::write(STATUS, 1)]);
    assert_eq!(r.status(), S_IOERR);
    // No writable byte at all: nothing to report into.
    r.header(T_IN, 0);
    assert_eq!(r.run(&[Buf::read(HDR, 16)])[0].1, 0);
    // Zero-length buffers.
    r.header(T_IN, 0);
    let used = r.run(&[Buf::read(HDR, 0), Buf::write(DATA, 0)]);
    assert_eq!(used[0].1, 0);
    // A buffer running off the end of guest memory.
    r.header(T_IN, 0);
    let used = r.run(&[Buf::read(HDR, 16), Buf::write(MEM as u64 - 512, 4096), Buf::write(STATUS, 1)]);
    assert_eq!(used[0].1, 0);
    assert_eq!(std::fs::read(r._file.path()).expect("disk")[..4096], pattern(0, 4096)[..], "disk untouched");
}

#[test]
fn descriptor_loops_and_overlong_chains_end() {
    let mut r = rig(false);
    // Descriptor 0 → 1 → 0 → … with the NEXT flag: a loop.
    r.header(T_IN, 0);
    r.drv.write_desc(&r.mem, 0, HDR, 16, F_NEXT, 1);
    r.drv.write_desc(&r.mem, 1, STATUS, 1, F_WRITE | F_NEXT, 0);
    r.drv.publish(&r.mem, 0);
    r.dev.process_queue(0, &mut r.queues, &r.mem);
    let used = r.drv.take_used(&r.mem);
    assert_eq!(used.len(), 1, "the looping chain is completed, not followed forever");
    // A chain pointing past the table's end.
    r.drv.write_desc(&r.mem, 2, HDR, 16, F_NEXT, 300);
    r.drv.publish(&r.mem, 2);
    r.dev.process_queue(0, &mut r.queues, &r.mem);
    // A head index past the queue.
    r.drv.publish(&r.mem, 999);
    r.dev.process_queue(0, &mut r.queues, &r.mem);
    r.drv.take_used(&r.mem);
    // The device still serves a good request afterwards.
    let mut good = rig(false);
    assert_eq!(good.read(0, 512), (S_OK, pattern(0, 512)));
}

#[test]
fn a_full_overlay_is_an_io_error_for_the_guest() {
    let base = tempfile::NamedTempFile::new().expect("temp");
    std::fs::write(base.path(), pattern(0, 1 << 20)).expect("base");
    let dir = tempfile::tempdir().expect("dir");
    let disk = CowDisk::open(base.path(), &dir.path().join("ov"), 8192).expect("opens");
    let mut r = rig_with(Box::new(disk), false, base);
    assert_eq!(r.write(0, &[1u8; 8192]), S_OK);
    assert_eq!(r.write(16, &[2u8; 4096]), S_IOERR, "no room for a third block");
    assert_eq!(r.read(16, 512), (S_OK, pattern(8192, 512)));
    assert_eq!(r.read(0, 512), (S_OK, vec![1u8; 512]));
    assert_eq!(std::fs::read(r._file.path()).expect("base"), pattern(0, 1 << 20), "the base is untouched");
}

/// Writes `value` to the transport's register at `offset`, as a vCPU does.
fn w(t: &mut crate::devices::virtio::MmioTransport, offset: u64, value: u32) {
    crate::devices::bus::BusDevice::write(t, offset, &value.to_le_bytes());
}

/// The rig's device behind a transport, the driver's features acked and
/// its queue (at `RING`, 256 entries) set up as Linux does, up to DRIVER_OK.
fn transport(
    r: Rig,
) -> (crate::devices::virtio::MmioTransport, std::sync::Arc<GuestMemoryMmap>, vmm_sys_util::eventfd::EventFd) {
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
    let mem = std::sync::Arc::new(r.mem.clone());
    let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    let line = crate::devices::IrqLine(irq.try_clone().expect("clone"));
    let mut t = crate::devices::virtio::MmioTransport::new(Box::new(r.dev), mem.clone(), line).expect("transport");
    set_up(&mut t);
    (t, mem, irq)
}

fn set_up(t: &mut crate::devices::virtio::MmioTransport) {
    w(t, 0x70, 3);
    w(t, 0x24, 1);
    w(t, 0x20, 1);
    w(t, 0x70, 0xb);
    w(t, 0x38, 256);
    w(t, 0x80, RING as u32);
    w(t, 0x90, (RING + 16 * 256) as u32);
    w(t, 0xa0, ((RING + 16 * 256 + 6 + 512).next_multiple_of(4)) as u32);
    w(t, 0x44, 1);
    w(t, 0x70, 0xf);
}

#[test]
fn a_driver_that_keeps_adding_buffers_gets_one_queues_worth_a_pass() {
    // The guest's request reads sector 0 over the available ring itself:
    // its flags, its index (now 257: 256 more chains) and its entries (all
    // this same chain). Each request so makes more available as it is
    // served, as a guest vCPU could keep doing for ever.
    let mut sector = [0u8; 512];
    sector[2..4].copy_from_slice(&257u16.to_le_bytes());
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), sector.repeat(8)).expect("disk written");
    let disk = RawDisk::open(file.path(), false).expect("opens");
    let r = rig_with(Box::new(disk), false, file);
    let (mut t, mem, irq) = transport(r);
    let mut drv = QueueDriver::new(RING, 256);
    let (_, avail, used) = drv.addresses();
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&T_IN.to_le_bytes());
    mem.write_slice(&h, GuestAddress(HDR)).expect("header");
    drv.add_chain(&mem, &[Buf::read(HDR, 16), Buf::write(avail, 512), Buf::write(STATUS, 1)]);
    let used_idx = || -> u16 { mem.read_obj(GuestAddress(used + 2)).expect("used index") };
    w(&mut t, 0x50, 0);
    t.process_notifications();
    assert_eq!(used_idx(), 256, "one pass serves one queue's worth, not all the guest keeps making available");
    assert!(irq.read().is_ok(), "the guest is told of what was served");
    // The queue's eventfd is signalled again, so the VMM loop, after its
    // other events, comes back for the rest.
    assert!(t.queue_events()[0].read().is_ok(), "the rest is left for the next pass");
    t.queue_events()[0].write(1).expect("signal");
    t.process_notifications();
    assert_eq!(used_idx(), 257);
    assert!(t.queue_events()[0].read().is_err(), "nothing more: no pass is asked for");
}

#[test]
fn transport_reset_during_io_serves_nothing_further() {
    use std::sync::Arc;
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    use crate::devices::IrqLine;
    use crate::devices::virtio::MmioTransport;

    let r = rig(false);
    let mem = Arc::new(r.mem.clone());
    let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    let mut t =
        MmioTransport::new(Box::new(r.dev), mem.clone(), IrqLine(irq.try_clone().expect("clone"))).expect("transport");
    // A notification before any setup is ignored.
    w(&mut t, 0x50, 0);
    t.process_notifications();
    assert!(irq.read().is_err());
    set_up(&mut t);
    let mut drv = QueueDriver::new(RING, 256);
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&T_IN.to_le_bytes());
    mem.write_slice(&h, GuestAddress(HDR)).expect("header");
    drv.add_chain(&mem, &[Buf::read(HDR, 16), Buf::write(DATA, 512), Buf::write(STATUS, 1)]);
    w(&mut t, 0x50, 0);
    // The driver resets the device before the VMM thread got to it.
    w(&mut t, 0x70, 0);
    t.process_notifications();
    assert!(drv.take_used(&mem).is_empty(), "nothing served after the reset");
    assert!(irq.read().is_err());
}

#[test]
fn write_zeroes_and_discard_take_one_checked_segment() {
    let mut r = rig(false);
    assert_ne!(r.dev.features() & (F_DISCARD | F_WRITE_ZEROES), 0);
    let seg = |r: &Rig, sector: u64, sectors: u32, flags: u32| {
        let mut s = [0u8; 16];
        s[0..8].copy_from_slice(&sector.to_le_bytes());
        s[8..12].copy_from_slice(&sectors.to_le_bytes());
        s[12..16].copy_from_slice(&flags.to_le_bytes());
        r.mem.write_slice(&s, GuestAddress(DATA)).expect("segment");
    };
    let run = |r: &mut Rig, kind: u32, len: u32| {
        r.header(kind, 0);
        r.run(&[Buf::read(HDR, 16), Buf::read(DATA, len), Buf::write(STATUS, 1)]);
        r.status()
    };
    seg(&r, 2, 4, 0);
    assert_eq!(run(&mut r, T_WRITE_ZEROES, 16), S_OK);
    assert_eq!(r.read(2, 2048), (S_OK, vec![0u8; 2048]));
    assert_eq!(r.read(6, 512), (S_OK, pattern(3072, 512)), "only the range");
    seg(&r, 0, 8, 0);
    assert_eq!(run(&mut r, T_DISCARD, 16), S_OK);
    for (sector, sectors, flags, len) in
        [(0, 0, 0, 16), (2047, 2, 0, 16), (0, 8, 4, 16), (0, 8, 0, 32), (u64::MAX, 1, 0, 16)]
    {
        seg(&r, sector, sectors, flags);
        assert_eq!(run(&mut r, T_DISCARD, len), S_IOERR, "{sector} {sectors} {flags} {len}");
    }
    let mut ro = rig(true);
    assert_eq!(ro.dev.features() & (F_DISCARD | F_WRITE_ZEROES), 0);
    seg(&ro, 0, 1, 0);
    assert_eq!(run(&mut ro, T_WRITE_ZEROES, 16), S_IOERR);
    let mut cfg = [0u8; 4];
    r.dev.read_config(48, &mut cfg);
    assert_eq!(u32::from_le_bytes(cfg), MAX_WRITE_ZEROES_SECTORS);
}
