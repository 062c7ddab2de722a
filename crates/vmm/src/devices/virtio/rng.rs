//! virtio-rng: an entropy source for the guest, filled from the host's
//! `getrandom(2)`. Linux's `virtio_rng` feeds it to the kernel's pool, so a
//! fresh microVM does not wait for entropy at boot. A token bucket limits
//! the rate; a throttled device leaves the guest's buffers queued and
//! serves them when its timer (the device's host descriptor) fires.

use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestMemoryMmap};
use vmm_sys_util::timerfd::TimerFd;

use super::{TYPE_RNG, VirtioDevice};

/// One request queue.
const QUEUE_SIZES: &[u16] = &[256];
/// At most this many bytes per request, so one request cannot keep the
/// VMM thread busy for long.
const MAX_REQUEST_BYTES: u32 = 64 * 1024;
/// Sustained entropy rate: far more than a guest's pool needs, far less
/// than would let a guest turn the VMM into a getrandom(2) pump.
pub const RATE_BYTES_PER_SEC: u64 = 1 << 20;
/// What a guest may take at once (its boot-time fill) before the rate applies.
pub const BURST_BYTES: u64 = 256 * 1024;
/// How long a throttled device waits before serving again.
const THROTTLE_WAIT: Duration = Duration::from_millis(20);

/// A token bucket of bytes.
#[derive(Debug)]
pub struct TokenBucket {
    rate: u64,
    capacity: u64,
    tokens: u64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket of `capacity` bytes refilled at `rate` bytes a second.
    pub fn new(rate: u64, capacity: u64) -> Self {
        Self { rate, capacity, tokens: capacity, last: Instant::now() }
    }

    /// Takes up to `want` bytes; returns how many were granted.
    pub fn take(&mut self, want: u64) -> u64 {
        let now = Instant::now();
        let earned =
            u64::try_from(now.duration_since(self.last).as_micros()).unwrap_or(u64::MAX).saturating_mul(self.rate)
                / 1_000_000;
        if earned > 0 {
            self.tokens = self.tokens.saturating_add(earned).min(self.capacity);
            self.last = now;
        }
        let granted = want.min(self.tokens);
        self.tokens -= granted;
        granted
    }
}

/// The entropy device.
#[derive(Debug)]
pub struct Rng {
    bucket: TokenBucket,
    timer: TimerFd,
    throttled: bool,
}

impl Rng {
    /// A new entropy device limited to `RATE_BYTES_PER_SEC`.
    pub fn new() -> std::io::Result<Self> {
        Self::with_rate(RATE_BYTES_PER_SEC, BURST_BYTES)
    }

    /// A device serving `rate` bytes a second after a burst of `burst`.
    pub fn with_rate(rate: u64, burst: u64) -> std::io::Result<Self> {
        let timer = TimerFd::new()?;
        // Non-blocking: reading a timer that has not fired must not stall
        // the VMM thread.
        // SAFETY: fcntl on a descriptor this timer owns; no memory is passed.
        if unsafe { libc::fcntl(timer.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { bucket: TokenBucket::new(rate, burst), timer, throttled: false })
    }

    fn serve(&mut self, queue: &mut Queue, mem: &GuestMemoryMmap) -> bool {
        let mut used_any = false;
        let mut left = queue.size();
        loop {
            if self.throttled {
                break;
            }
            let Some(chain) = super::next_chain(queue, mem, &mut left) else { break };
            let head = chain.head_index();
            let mut written = 0u32;
            for desc in chain.writable() {
                let want = desc.len().min(MAX_REQUEST_BYTES - written);
                let len = u32::try_from(self.bucket.take(u64::from(want))).unwrap_or(0);
                let mut bytes = vec![0u8; usize::try_from(len).unwrap_or(0)];
                if !fill_random(&mut bytes) || mem.write_slice(&bytes, desc.addr()).is_err() {
                    break;
                }
                written += len;
                if len < want {
                    // Out of tokens: this request gets what there was, the
                    // rest wait for the timer.
                    self.throttled = true;
                    if let Err(e) = self.timer.reset(THROTTLE_WAIT, None) {
                        crate::guest_triggered!(warn, "virtio-rng: cannot arm its refill timer: {e}");
                        self.throttled = false;
                    }
                    break;
                }
                if written == MAX_REQUEST_BYTES {
                    break;
                }
            }
            if let Err(e) = queue.add_used(mem, head, written) {
                crate::guest_triggered!(warn, "virtio-rng: cannot return a buffer to the guest: {e}");
                break;
            }
            used_any = true;
        }
        used_any
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

    fn reset(&mut self) {
        // Not disarming the timer: a reset comes from a register write on a
        // vCPU thread, whose seccomp filter has no timerfd_settime. A timer
        // still armed just fires once more on the VMM thread, finding
        // nothing to serve.
        self.throttled = false;
    }

    fn process_queue(&mut self, _index: usize, queues: &mut [Queue], mem: &GuestMemoryMmap) -> bool {
        match queues.first_mut() {
            Some(queue) => self.serve(queue, mem),
            None => false,
        }
    }

    fn host_fd(&self) -> Option<RawFd> {
        Some(self.timer.as_raw_fd())
    }

    fn process_host(&mut self, queues: Option<&mut [Queue]>, mem: &GuestMemoryMmap) -> bool {
        // Reading clears the expiry; an error means it has not fired yet.
        if self.timer.wait().is_ok() {
            self.throttled = false;
        }
        match queues.and_then(|q| q.first_mut()) {
            Some(queue) => self.serve(queue, mem),
            None => false,
        }
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
            let rng = Rng::new().expect("timerfd");
            Self { dev: MmioTransport::new(Box::new(rng), mem.clone(), line).expect("transport"), mem, irq }
        }
        fn read(&mut self, offset: u64) -> u32 {
            let mut b = [0u8; 4];
            self.dev.read(offset, &mut b);
            u32::from_le_bytes(b)
        }
        fn write(&mut self, offset: u64, value: u32) {
            self.dev.write(offset, &value.to_le_bytes());
            // What the VMM thread does when the queue's eventfd fires.
            self.dev.process_notifications();
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
        // Writing the status again without the flag does not clear it: only
        // a reset does.
        d.write(0x70, status & !crate::devices::virtio::mmio::STATUS_DEVICE_NEEDS_RESET);
        let again = d.read(0x70);
        assert_ne!(again & crate::devices::virtio::mmio::STATUS_DEVICE_NEEDS_RESET, 0, "{again:#x}");
        d.write(0x50, 0);
        assert!(d.irq.read().is_err(), "still nothing served on rings that failed the check");
    }

    #[test]
    fn the_rate_is_limited_and_throttled_requests_are_served_later() {
        let mem = crate::devices::virtio::testing::guest_memory(1 << 20);
        let mut drv = crate::devices::virtio::testing::QueueDriver::new(0x1000, 16);
        let mut queues = vec![drv.queue()];
        let mut rng = Rng::with_rate(1000, 4096).expect("timerfd");
        use crate::devices::virtio::testing::Buf;
        drv.add_chain(&mem, &[Buf::write(0x4_0000, 3000)]);
        drv.add_chain(&mem, &[Buf::write(0x5_0000, 3000)]);
        drv.add_chain(&mem, &[Buf::write(0x6_0000, 3000)]);
        assert!(rng.process_queue(0, &mut queues, &mem));
        let used = drv.take_used(&mem);
        assert_eq!(used.iter().map(|u| u.1).collect::<Vec<_>>(), vec![3000, 1096], "the burst, then throttled");
        // The third waits for the timer, which the VMM loop polls.
        assert!(!rng.process_queue(0, &mut queues, &mem));
        let mut fds = [libc::pollfd { fd: rng.host_fd().expect("timer"), events: libc::POLLIN, revents: 0 }];
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(fds.as_mut_ptr(), 1, 2000) }, 1, "the refill timer fires");
        assert!(rng.process_host(Some(&mut queues), &mem));
        let used = drv.take_used(&mem);
        assert_eq!(used.len(), 1);
        assert!(used[0].1 > 0 && used[0].1 < 1000, "{used:?}: about 20 ms worth at 1000 B/s");
    }
}
