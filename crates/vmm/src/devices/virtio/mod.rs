//! virtio over MMIO: the transport (`mmio`), the device model interface
//! (`VirtioDevice`), and the devices (`block`, `net`, `vsock`, `rng`).
//!
//! Queues are split virtqueues from rust-vmm's `virtio-queue`. A queue
//! notification is a write to the transport's `QueueNotify` register, which
//! KVM turns into a write to that queue's eventfd (an ioeventfd with the
//! queue index as its datamatch) without leaving the guest; the VMM thread
//! waits on those eventfds and runs the device there, never on a vCPU
//! thread. A device interrupts the guest through an irqfd. Devices with
//! host-side work (vsock's sockets, net's passt socket, rng's refill timer) expose one pollable
//! descriptor that the VMM loop watches too.
//!
//! One pass over a queue serves at most one queue's worth of the chains
//! the driver made available ([`next_chain`]): a driver that keeps adding
//! cheap buffers as fast as they are used would otherwise hold the VMM
//! thread in one pass for ever, and with it the control socket, the other
//! devices and the host's requests to pause or stop the VM. The transport
//! signals such a queue's eventfd again, so the rest is served after the
//! loop's other events had their turn.

pub mod block;
pub mod mmio;
pub mod net;
pub mod rng;
#[doc(hidden)]
pub mod testing;
pub mod vsock;

use std::os::fd::RawFd;

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::GuestMemoryMmap;

pub use mmio::MmioTransport;

/// The next chain of `queue` while this pass may serve more: `left`
/// starts at the queue's size ([`QueueT::size`]) and counts down; `None`
/// once it is spent or the queue is empty.
pub(crate) fn next_chain<'a>(
    queue: &mut Queue,
    mem: &'a GuestMemoryMmap,
    left: &mut u16,
) -> Option<DescriptorChain<&'a GuestMemoryMmap>> {
    *left = left.checked_sub(1)?;
    queue.pop_descriptor_chain(mem)
}

/// Device ids (virtio 1.2, §5).
pub const TYPE_NET: u32 = 1;
/// Block device.
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
    /// The driver reset the device: everything in flight is dropped.
    fn reset(&mut self) {}
    /// Handles buffers the driver made available on queue `index` (of
    /// `queues`, all of them ready); returns whether any were used (and the
    /// driver should be interrupted).
    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMemoryMmap) -> bool;
    /// A descriptor the VMM loop polls for this device's host-side work.
    fn host_fd(&self) -> Option<RawFd> {
        None
    }
    /// The host descriptor is ready. `queues` is `None` while the driver has
    /// not (or no longer) set the device up; the device must still consume
    /// the event. Returns whether buffers were used.
    fn process_host(&mut self, _queues: Option<&mut [Queue]>, _mem: &GuestMemoryMmap) -> bool {
        false
    }
}

/// Bytes of a virtio-mmio register: little-endian reads of a config field
/// `value` at `offset` within a config space that places it at `field`.
pub(crate) fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(offset) = usize::try_from(offset) else { return };
    if let Some(src) = config.get(offset..) {
        let n = src.len().min(data.len());
        data[..n].copy_from_slice(&src[..n]);
    }
}
