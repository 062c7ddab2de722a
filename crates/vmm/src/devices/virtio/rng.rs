//! virtio-rng: an entropy source for the guest, filled from the host's
//! `getrandom(2)`. Linux's `virtio_rng` feeds it to the kernel's pool, so a
//! fresh microVM does not wait for entropy at boot.

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestMemoryMmap};

use super::{TYPE_RNG, VirtioDevice};

/// One request queue.
const QUEUE_SIZES: &[u16] = &[256];
/// At most this many bytes per request, so one notification cannot keep
/// a vCPU thread busy for long.
const MAX_REQUEST_BYTES: u32 = 64 * 1024;

/// The entropy device.
#[derive(Debug, Default)]
pub struct Rng;

impl Rng {
    /// A new entropy device.
    pub fn new() -> Self {
        Self
    }
}

fn fill_random(buf: &mut [u8]) -> bool {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: the pointer and length describe the writable tail of `buf`.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        match usize::try_from(n) {
            Ok(n) => done += n,
            Err(_) if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        TYPE_RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn process_queue(&mut self, _index: usize, queue: &mut Queue, mem: &GuestMemoryMmap) -> bool {
        let mut used_any = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let mut written = 0u32;
            for desc in chain.writable() {
                let len = desc.len().min(MAX_REQUEST_BYTES - written);
                let mut bytes = vec![0u8; usize::try_from(len).unwrap_or(0)];
                if !fill_random(&mut bytes) || mem.write_slice(&bytes, desc.addr()).is_err() {
                    break;
                }
                written += len;
                if written == MAX_REQUEST_BYTES {
                    break;
                }
            }
            if let Err(e) = queue.add_used(mem, head, written) {
                tracing::warn!("virtio-rng: cannot return a buffer to the guest: {e}");
                break;
            }
            used_any = true;
        }
        used_any
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use vm_memory::{GuestAddress, GuestMemoryMmap};
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    use super::*;
    use crate::devices::IrqLine;
    use crate::devices::bus::BusDevice;
    use crate::devices::virtio::MmioTransport;
    use crate::devices::virtio::mmio::{
        INT_USED_BUFFER, STATUS_ACKNOWLEDGE, STATUS_DRIVER, STATUS_DRIVER_OK, STATUS_FEATURES_OK,
    };

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const BUF: u64 = 0x4000;

    struct Driver {
        dev: MmioTransport,
        mem: Arc<GuestMemoryMmap>,
        irq: EventFd,
    }

    impl Driver {
        fn new() -> Self {
            let mem = Arc::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("memory"));
            let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
            let line = IrqLine(irq.try_clone().expect("clone"));
            Self { dev: MmioTransport::new(Box::new(Rng::new()), mem.clone(), line), mem, irq }
        }
        fn read(&mut self, offset: u64) -> u32 {
            let mut b = [0u8; 4];
            self.dev.read(offset, &mut b);
            u32::from_le_bytes(b)
        }
        fn write(&mut self, offset: u64, value: u32) {
            self.dev.write(offset, &value.to_le_bytes());
        }
        fn status(&mut self, bits: u32) {
            let status = self.read(0x70) | bits;
            self.write(0x70, status);
        }
        /// The Linux driver's sequence (virtio 1.2, §3.1.1) up to DRIVER_OK.
        fn bring_up(&mut self, driver_features_high: u32) -> bool {
            self.status(STATUS_ACKNOWLEDGE | STATUS_DRIVER);
            self.write(0x14, 1);
            assert_eq!(self.read(0x10) & 1, 1, "VERSION_1 offered");
            self.write(0x24, 1);
            self.write(0x20, driver_features_high);
            self.status(STATUS_FEATURES_OK);
            if self.read(0x70) & STATUS_FEATURES_OK == 0 {
                return false;
            }
            self.write(0x30, 0);
            assert_eq!(self.read(0x34), 256);
            self.write(0x38, 4);
            self.write(0x80, u32::try_from(DESC).expect("low"));
            self.write(0x84, 0);
            self.write(0x90, u32::try_from(AVAIL).expect("low"));
            self.write(0x94, 0);
            self.write(0xa0, u32::try_from(USED).expect("low"));
            self.write(0xa4, 0);
            self.write(0x44, 1);
            self.status(STATUS_DRIVER_OK);
            true
        }
        /// Offers one write-only buffer of `len` bytes as descriptor 0.
        fn offer(&mut self, len: u32) {
            self.offer_raw(BUF, len, 2, 0);
        }
        /// Offers descriptor 0 as given (flags: 1 NEXT, 2 WRITE).
        fn offer_raw(&mut self, addr: u64, len: u32, flags: u16, next: u16) {
            let m = &*self.mem;
            m.write_obj(addr, GuestAddress(DESC)).expect("desc addr");
            m.write_obj(len, GuestAddress(DESC + 8)).expect("desc len");
            m.write_obj(flags, GuestAddress(DESC + 12)).expect("desc flags");
            m.write_obj(next, GuestAddress(DESC + 14)).expect("desc next");
            let idx: u16 = m.read_obj(GuestAddress(AVAIL + 2)).expect("avail idx");
            m.write_obj(0u16, GuestAddress(AVAIL + 4 + 2 * u64::from(idx % 4))).expect("avail ring");
            m.write_obj(idx.wrapping_add(1), GuestAddress(AVAIL + 2)).expect("avail idx");
        }
        fn used(&self) -> (u16, u32) {
            let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).expect("used idx");
            let slot = u64::from(idx.wrapping_sub(1) % 4);
            let len: u32 = self.mem.read_obj(GuestAddress(USED + 8 + 8 * slot)).expect("used len");
            (idx, len)
        }
    }

    #[test]
    fn identifies_as_a_modern_virtio_mmio_rng() {
        let mut d = Driver::new();
        assert_eq!(d.read(0x000), 0x7472_6976);
        assert_eq!(d.read(0x004), 2);
        assert_eq!(d.read(0x008), TYPE_RNG);
    }

    #[test]
    fn fills_a_buffer_the_driver_offers_and_interrupts() {
        let mut d = Driver::new();
        assert!(d.bring_up(1), "VERSION_1 accepted");
        assert_eq!(d.read(0x70) & STATUS_DRIVER_OK, STATUS_DRIVER_OK);
        d.offer(64);
        d.write(0x50, 0); // QueueNotify
        let used_idx: u16 = d.mem.read_obj(GuestAddress(USED + 2)).expect("used idx");
        assert_eq!(used_idx, 1);
        let id: u32 = d.mem.read_obj(GuestAddress(USED + 4)).expect("used id");
        let len: u32 = d.mem.read_obj(GuestAddress(USED + 8)).expect("used len");
        assert_eq!((id, len), (0, 64));
        let mut bytes = [0u8; 64];
        d.mem.read_slice(&mut bytes, GuestAddress(BUF)).expect("buffer");
        assert!(bytes.iter().any(|b| *b != 0), "random bytes written");
        assert_eq!(d.read(0x60), INT_USED_BUFFER);
        assert!(d.irq.read().is_ok(), "interrupt raised");
        d.write(0x64, INT_USED_BUFFER);
        assert_eq!(d.read(0x60), 0);
    }

    #[test]
    fn legacy_drivers_are_refused() {
        let mut d = Driver::new();
        assert!(!d.bring_up(0), "FEATURES_OK must stay clear without VERSION_1");
    }

    #[test]
    fn requests_are_capped_and_reset_clears_everything() {
        let mut d = Driver::new();
        assert!(d.bring_up(1));
        d.offer(1 << 20);
        d.write(0x50, 0);
        let len: u32 = d.mem.read_obj(GuestAddress(USED + 8)).expect("used len");
        assert_eq!(len, MAX_REQUEST_BYTES);
        d.write(0x70, 0);
        assert_eq!((d.read(0x70), d.read(0x60), d.read(0x44)), (0, 0, 0));
        d.write(0x50, 0);
        assert!(d.irq.read().is_ok(), "the earlier interrupt only");
        assert!(d.irq.read().is_err(), "no notify is served after reset");
    }

    #[test]
    fn notifications_before_setup_are_ignored() {
        let mut d = Driver::new();
        d.offer(16);
        d.write(0x50, 0);
        d.write(0x50, 7);
        assert_eq!(d.used().0, 0);
        assert!(d.irq.read().is_err());
    }

    #[test]
    fn hostile_buffers_are_returned_empty_without_touching_other_memory() {
        let mut d = Driver::new();
        assert!(d.bring_up(1));
        // Outside guest memory.
        d.offer_raw(1 << 40, 64, 2, 0);
        d.write(0x50, 0);
        assert_eq!(d.used(), (1, 0));
        // Zero length.
        d.offer_raw(BUF, 0, 2, 0);
        d.write(0x50, 0);
        assert_eq!(d.used(), (2, 0));
        // Device-readable only: nothing to write into.
        d.offer_raw(BUF, 64, 0, 0);
        d.write(0x50, 0);
        assert_eq!(d.used(), (3, 0));
        let mut bytes = [0u8; 64];
        d.mem.read_slice(&mut bytes, GuestAddress(BUF)).expect("buffer");
        assert_eq!(bytes, [0u8; 64], "no buffer was written");
        // A descriptor chained to itself ends (the chain is bounded by the
        // queue size) rather than looping forever.
        d.offer_raw(BUF, 8, 2 | 1, 0);
        d.write(0x50, 0);
        assert_eq!(d.used().0, 4);
        // A queue index past the device's queues.
        d.write(0x50, 9);
    }

    #[test]
    fn a_queue_outside_guest_memory_fails_driver_ok() {
        let mut d = Driver::new();
        d.status(STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        d.write(0x24, 1);
        d.write(0x20, 1);
        d.status(STATUS_FEATURES_OK);
        d.write(0x30, 0);
        d.write(0x38, 4);
        d.write(0x80, 0);
        d.write(0x84, 0x100); // 1 TiB: no such memory
        d.write(0x44, 1);
        d.status(STATUS_DRIVER_OK);
        let status = d.read(0x70);
        assert_ne!(status & crate::devices::virtio::mmio::STATUS_DEVICE_NEEDS_RESET, 0, "{status:#x}");
        // Even with a good ring to serve, a device needing reset serves nothing.
        d.offer(16);
        d.write(0x50, 0);
        assert!(d.irq.read().is_err(), "a failed device serves nothing");
    }
}
