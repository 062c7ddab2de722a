//! The boot timer: an MMIO register the guest's init writes once it is
//! ready, so the host knows how long the boot took without parsing the
//! console.
//!
//! Protocol: a one-byte write of [`READY_MAGIC`] (123, as Firecracker's boot
//! timer) at offset 0 of the page at `layout::BOOT_TIMER_ADDR` marks the
//! guest ready; the VMM records the time since it started and logs it. Other
//! values are logged as boot progress markers. Reads return 0. In the guest,
//! `moat-agent` can write it through `/dev/mem` (mmap the page, write 123).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::bus::BusDevice;

/// The value that marks the guest ready.
pub const READY_MAGIC: u8 = 123;

/// Microseconds from VMM start to guest ready; 0 until then.
#[derive(Debug, Clone, Default)]
pub struct BootReady(Arc<AtomicU64>);

impl BootReady {
    /// Time from VMM start to the guest's ready write, once it happened.
    pub fn micros(&self) -> Option<u64> {
        Some(self.0.load(Ordering::Acquire)).filter(|us| *us != 0)
    }
}

/// The MMIO device.
#[derive(Debug)]
pub struct BootTimer {
    start: Instant,
    ready: BootReady,
}

impl BootTimer {
    /// A timer counting from `start` (the VMM's start).
    pub fn new(start: Instant) -> (Self, BootReady) {
        let ready = BootReady::default();
        (Self { start, ready: ready.clone() }, ready)
    }
}

impl BusDevice for BootTimer {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let elapsed = self.start.elapsed();
        match (offset, data.first()) {
            (0, Some(&READY_MAGIC)) => {
                let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX).max(1);
                // Only the first ready counts: a later one is a reboot's or a
                // confused guest's.
                if self.ready.0.compare_exchange(0, us, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    crate::guest_triggered!(info, "Guest ready after {} µs ({} ms)", us, us / 1000);
                }
            }
            (_, value) => {
                crate::guest_triggered!(info, "Guest boot marker {value:?} at offset {offset} after {elapsed:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_the_first_ready_write_only() {
        let (mut timer, ready) = BootTimer::new(Instant::now());
        assert_eq!(ready.micros(), None);
        timer.write(0, &[1]);
        assert_eq!(ready.micros(), None, "markers are not ready");
        timer.write(0, &[READY_MAGIC]);
        let first = ready.micros().expect("ready recorded");
        assert!(first >= 1);
        std::thread::sleep(std::time::Duration::from_millis(2));
        timer.write(0, &[READY_MAGIC]);
        assert_eq!(ready.micros(), Some(first));
        let mut data = [9u8; 4];
        timer.read(0, &mut data);
        assert_eq!(data, [0; 4]);
    }
}
