//! Address-range dispatch of vCPU exits: one bus for port I/O, one for MMIO.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device on a bus, addressed by offset from its base.
pub trait BusDevice: Send {
    /// A guest read of `data.len()` bytes at `offset`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A guest write of `data` at `offset`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Why a device could not be placed on a bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("Device range {base:#x}+{len:#x} overlaps another device or is empty")]
    Overlap { base: u64, len: u64 },
}

/// Shared handle to a device on a bus.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

/// Non-overlapping address ranges, each served by one device.
#[derive(Default, Clone)]
pub struct Bus {
    ranges: BTreeMap<u64, (u64, SharedDevice)>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.ranges.iter().map(|(base, (len, _))| (*base, *len))).finish()
    }
}

impl Bus {
    /// Places `device` at `base..base + len`.
    pub fn insert(&mut self, device: SharedDevice, base: u64, len: u64) -> Result<(), BusError> {
        let end = base.checked_add(len).filter(|_| len > 0).ok_or(BusError::Overlap { base, len })?;
        let before = self.ranges.range(..end).next_back();
        if let Some((b, (l, _))) = before
            && b + l > base
        {
            return Err(BusError::Overlap { base, len });
        }
        self.ranges.insert(base, (len, device));
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(u64, &SharedDevice)> {
        let (base, (len, device)) = self.ranges.range(..=addr).next_back()?;
        (addr - base < *len).then_some((addr - base, device))
    }

    /// Dispatches a read; `false` when nothing is mapped at `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        let Some((offset, device)) = self.find(addr) else { return false };
        lock(device).read(offset, data);
        true
    }

    /// Dispatches a write; `false` when nothing is mapped at `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        let Some((offset, device)) = self.find(addr) else { return false };
        lock(device).write(offset, data);
        true
    }
}

/// Locks a device; a device whose holder panicked is still usable (its
/// state is plain registers), so poisoning is ignored.
pub fn lock<T: ?Sized>(device: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    device.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder(Vec<(u64, Vec<u8>)>);

    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(u8::try_from(offset).unwrap_or(0xff));
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatches_by_range_with_offsets() {
        let mut bus = Bus::default();
        let a = Arc::new(Mutex::new(Recorder::default()));
        bus.insert(a.clone(), 0x3f8, 8).expect("free range");
        assert!(bus.write(0x3f9, &[1]));
        assert!(!bus.write(0x400, &[1]));
        assert!(!bus.write(0x3f7, &[1]));
        let mut data = [0u8; 1];
        assert!(bus.read(0x3ff, &mut data));
        assert_eq!(data, [7]);
        assert_eq!(lock(&a).0, vec![(1, vec![1])]);
    }

    #[test]
    fn overlaps_are_refused() {
        let mut bus = Bus::default();
        let d = || Arc::new(Mutex::new(Recorder::default())) as SharedDevice;
        bus.insert(d(), 0x1000, 0x100).expect("free range");
        assert!(bus.insert(d(), 0x10ff, 1).is_err());
        assert!(bus.insert(d(), 0xf00, 0x101).is_err());
        assert!(bus.insert(d(), 0x2000, 0).is_err());
        bus.insert(d(), 0x1100, 1).expect("adjacent is fine");
        bus.insert(d(), 0xf00, 0x100).expect("adjacent below is fine");
    }
}
