//! virtio over MMIO: the transport (`mmio`), the device model interface
//! (`VirtioDevice`), and the devices (`rng`).
//!
//! Queues are split virtqueues from rust-vmm's `virtio-queue`. A queue
//! notification is a write to the transport's `QueueNotify` register, so a
//! device processes its queue on the vCPU thread that notified it; devices
//! that block or need host I/O in the background (block, vsock: M6) will
//! hand the work to the VMM thread instead.

pub mod mmio;
pub mod rng;

use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;

pub use mmio::MmioTransport;

/// Device ids (virtio 1.2, §5).
pub const TYPE_BLOCK: u32 = 2;
/// Entropy source.
pub const TYPE_RNG: u32 = 4;
/// Socket device.
pub const TYPE_VSOCK: u32 = 19;

/// `VIRTIO_F_VERSION_1`: a modern (non-legacy) device. Every moat device
/// offers it and requires it.
pub const F_VERSION_1: u64 = 1 << 32;

/// A virtio device model behind a transport.
pub trait VirtioDevice: Send {
    /// The virtio device id.
    fn device_type(&self) -> u32;
    /// The largest size of each queue; their number is the device's queue count.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits offered to the driver (`F_VERSION_1` is added by the transport).
    fn features(&self) -> u64 {
        0
    }
    /// Reads device configuration space at `offset`.
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    /// Writes device configuration space at `offset`.
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// The driver accepted `features` and set DRIVER_OK.
    fn activate(&mut self, _features: u64) {}
    /// The driver reset the device.
    fn reset(&mut self) {}
    /// Handles buffers the driver made available on queue `index`; returns
    /// whether any were used (and the driver should be interrupted).
    fn process_queue(&mut self, index: usize, queue: &mut Queue, mem: &GuestMemoryMmap) -> bool;
}
