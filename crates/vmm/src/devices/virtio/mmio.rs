//! The virtio-mmio transport, version 2 (virtio 1.2, §4.2.2): the register
//! file a driver uses to negotiate features, set up queues, notify the
//! device and acknowledge interrupts. The guest finds each transport through
//! the DSDT (`LNRO0005`, its window and its interrupt).
//!
//! A `QueueNotify` write signals that queue's eventfd (KVM does it itself
//! when the eventfd is registered as an ioeventfd, so the write never
//! reaches this code); the VMM thread then calls `process_notifications`.

use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vm_superio::Trigger;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::{F_VERSION_1, VirtioDevice};
use crate::devices::IrqLine;
use crate::devices::bus::BusDevice;

const MAGIC_VALUE: u32 = 0x7472_6976; // "virt"
/// The queues whose passes [`MmioTransport::come_back_for_the_rest`] tracks.
const TRACKED_QUEUES: usize = 8;
const VERSION: u32 = 2;
/// "MOAT", as the vendor id.
const VENDOR_ID: u32 = 0x5441_4f4d;

const REG_MAGIC: u64 = 0x000;
const REG_VERSION: u64 = 0x004;
const REG_DEVICE_ID: u64 = 0x008;
const REG_VENDOR_ID: u64 = 0x00c;
const REG_DEVICE_FEATURES: u64 = 0x010;
const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
const REG_DRIVER_FEATURES: u64 = 0x020;
const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
const REG_QUEUE_SEL: u64 = 0x030;
const REG_QUEUE_NUM_MAX: u64 = 0x034;
const REG_QUEUE_NUM: u64 = 0x038;
const REG_QUEUE_READY: u64 = 0x044;
const REG_QUEUE_NOTIFY: u64 = 0x050;
const REG_INTERRUPT_STATUS: u64 = 0x060;
const REG_INTERRUPT_ACK: u64 = 0x064;
const REG_STATUS: u64 = 0x070;
const REG_QUEUE_DESC_LOW: u64 = 0x080;
const REG_QUEUE_DESC_HIGH: u64 = 0x084;
const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
const REG_QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const REG_CONFIG_GENERATION: u64 = 0x0fc;
const CONFIG_SPACE: u64 = 0x100;

/// Device status bits (virtio 1.2, §2.1).
pub const STATUS_ACKNOWLEDGE: u32 = 1;
pub const STATUS_DRIVER: u32 = 2;
pub const STATUS_DRIVER_OK: u32 = 4;
pub const STATUS_FEATURES_OK: u32 = 8;
pub const STATUS_DEVICE_NEEDS_RESET: u32 = 0x40;
pub const STATUS_FAILED: u32 = 0x80;

/// Interrupt status: the device used buffers.
pub const INT_USED_BUFFER: u32 = 1;
/// Offset of the `QueueNotify` register, where ioeventfds are registered.
pub const QUEUE_NOTIFY_OFFSET: u64 = REG_QUEUE_NOTIFY;

/// One virtio-mmio window with its device.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: Arc<GuestMemoryMmap>,
    irq: IrqLine,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    queue_select: u32,
    device_features_select: u32,
    driver_features_select: u32,
    acked_features: u64,
    status: u32,
    interrupt_status: u32,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device.device_type())
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// A transport for `device` over guest memory `mem`, interrupting on
    /// `irq`; fails only when no eventfd can be created.
    pub fn new(device: Box<dyn VirtioDevice>, mem: Arc<GuestMemoryMmap>, irq: IrqLine) -> std::io::Result<Self> {
        let queues: Vec<Queue> = device
            .queue_max_sizes()
            .iter()
            .map(|max| Queue::new(*max).unwrap_or_else(|_| panic!("queue size {max} is a power of two ≤ 32768")))
            .collect();
        let queue_evts = queues.iter().map(|_| EventFd::new(EFD_NONBLOCK)).collect::<std::io::Result<_>>()?;
        Ok(Self {
            device,
            mem,
            irq,
            queues,
            queue_evts,
            queue_select: 0,
            device_features_select: 0,
            driver_features_select: 0,
            acked_features: 0,
            status: 0,
            interrupt_status: 0,
        })
    }

    /// One eventfd per queue, signalled by a `QueueNotify` write of its index.
    pub fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The device's host-side descriptor, if it has one.
    pub fn host_fd(&self) -> Option<std::os::fd::RawFd> {
        self.device.host_fd()
    }

    fn active(&self) -> bool {
        self.status & (STATUS_DRIVER_OK | STATUS_DEVICE_NEEDS_RESET | STATUS_FAILED) == STATUS_DRIVER_OK
    }

    /// Serves every queue whose eventfd was signalled (run on the VMM thread).
    pub fn process_notifications(&mut self) {
        let mut used = false;
        for index in 0..self.queue_evts.len() {
            // Reading clears the eventfd; an unsignalled one has nothing.
            if self.queue_evts[index].read().is_err() || !self.active() || !self.queues[index].ready() {
                continue;
            }
            let before = self.next_avail();
            used |= self.device.process_queue(index, &mut self.queues, &self.mem);
            self.come_back_for_the_rest(&before);
        }
        if used {
            self.interrupt();
        }
    }

    /// Lets the device handle its host descriptor's readiness.
    pub fn process_host(&mut self) {
        let active = self.active();
        let before = self.next_avail();
        let queues = active.then_some(&mut self.queues[..]);
        if self.device.process_host(queues, &self.mem) && active {
            self.interrupt();
        }
        if active {
            self.come_back_for_the_rest(&before);
        }
    }

    /// Where each queue's device will take its next chain.
    /// (An array, not a `Vec`: this runs at every notification. moat's
    /// devices have at most three queues; any past [`TRACKED_QUEUES`] would
    /// only not be resumed early.)
    fn next_avail(&self) -> [u16; TRACKED_QUEUES] {
        let mut at = [0; TRACKED_QUEUES];
        for (at, queue) in at.iter_mut().zip(&self.queues) {
            *at = queue.next_avail();
        }
        at
    }

    /// Signals again the eventfd of each queue whose device served a whole
    /// pass's share since `before` (one queue's worth, `super::next_chain`)
    /// while the driver has made more available: the VMM loop serves its
    /// other events first, then the rest of this queue.
    fn come_back_for_the_rest(&self, before: &[u16]) {
        for ((queue, event), before) in self.queues.iter().zip(&self.queue_evts).zip(before) {
            // The ring is read only for a queue that used its whole share.
            if queue.next_avail().wrapping_sub(*before) >= queue.size()
                && queue
                    .avail_idx(&*self.mem, std::sync::atomic::Ordering::Acquire)
                    .is_ok_and(|avail| avail.0 != queue.next_avail())
                && let Err(e) = event.write(1)
            {
                crate::guest_triggered!(
                    warn,
                    "virtio device {}: cannot resume a queue: {e}",
                    self.device.device_type()
                );
            }
        }
    }

    fn interrupt(&mut self) {
        self.interrupt_status |= INT_USED_BUFFER;
        if let Err(e) = self.irq.trigger() {
            crate::guest_triggered!(
                warn,
                "virtio device {}: cannot raise its interrupt: {e}",
                self.device.device_type()
            );
        }
    }

    fn offered_features(&self) -> u64 {
        self.device.features() | F_VERSION_1
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        // Queue registers change only while the driver sets the device up.
        if self.status & STATUS_FEATURES_OK == 0 || self.status & STATUS_DRIVER_OK != 0 {
            return None;
        }
        self.queues.get_mut(usize::try_from(self.queue_select).ok()?)
    }

    fn reset(&mut self) {
        self.device.reset();
        self.queues.iter_mut().for_each(QueueT::reset);
        self.queue_select = 0;
        self.device_features_select = 0;
        self.driver_features_select = 0;
        self.acked_features = 0;
        self.status = 0;
        self.interrupt_status = 0;
        // Notifications from before the reset are void.
        for evt in &self.queue_evts {
            let _ = evt.read();
        }
    }

    fn set_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        // DEVICE_NEEDS_RESET stays until the driver resets the device (it
        // cannot clear it by writing the status again, which would
        // otherwise make the device active on rings that failed the check).
        let value = value | (self.status & STATUS_DEVICE_NEEDS_RESET);
        let newly = value & !self.status;
        if newly & STATUS_FEATURES_OK != 0 {
            let offered = self.offered_features();
            if self.acked_features & !offered != 0 || self.acked_features & F_VERSION_1 == 0 {
                crate::guest_triggered!(
                    warn,
                    "virtio device {}: driver features {:#x} are not a modern subset of {offered:#x}",
                    self.device.device_type(),
                    self.acked_features
                );
                // FEATURES_OK stays clear: the driver sees the refusal.
                self.status = value & !STATUS_FEATURES_OK;
                return;
            }
        }
        if newly & STATUS_DRIVER_OK != 0 {
            let mem = &*self.mem;
            if self.status & STATUS_FEATURES_OK == 0 || self.queues.iter().any(|q| q.ready() && !q.is_valid(mem)) {
                crate::guest_triggered!(
                    warn,
                    "virtio device {}: the driver's queue setup is invalid; the device needs a reset",
                    self.device.device_type()
                );
                self.status = value | STATUS_DEVICE_NEEDS_RESET;
                return;
            }
            self.device.activate(self.acked_features);
        }
        self.status = value;
    }

    /// A `QueueNotify` write that KVM did not take as an ioeventfd (none
    /// registered, or a notification of a queue the device lacks): the same
    /// eventfd is signalled, so the work still happens on the VMM thread.
    fn notify(&mut self, index: u32) {
        let Some(evt) = usize::try_from(index).ok().and_then(|i| self.queue_evts.get(i)) else { return };
        if let Err(e) = evt.write(1) {
            crate::guest_triggered!(
                warn,
                "virtio device {}: cannot signal queue {index}: {e}",
                self.device.device_type()
            );
        }
    }

    fn read_register(&self, offset: u64) -> u32 {
        let queue = usize::try_from(self.queue_select).ok().and_then(|i| self.queues.get(i));
        match offset {
            REG_MAGIC => MAGIC_VALUE,
            REG_VERSION => VERSION,
            REG_DEVICE_ID => self.device.device_type(),
            REG_VENDOR_ID => VENDOR_ID,
            REG_DEVICE_FEATURES => match self.device_features_select {
                0 => u32::try_from(self.offered_features() & 0xffff_ffff).unwrap_or_default(),
                1 => u32::try_from(self.offered_features() >> 32).unwrap_or_default(),
                _ => 0,
            },
            REG_QUEUE_NUM_MAX => queue.map_or(0, |q| u32::from(q.max_size())),
            REG_QUEUE_READY => queue.map_or(0, |q| u32::from(q.ready())),
            REG_INTERRUPT_STATUS => self.interrupt_status,
            REG_STATUS => self.status,
            REG_CONFIG_GENERATION => 0,
            _ => 0,
        }
    }

    fn write_register(&mut self, offset: u64, value: u32) {
        match offset {
            REG_DEVICE_FEATURES_SEL => self.device_features_select = value,
            REG_DRIVER_FEATURES_SEL => self.driver_features_select = value,
            REG_DRIVER_FEATURES => {
                if self.status & STATUS_DRIVER != 0 && self.status & STATUS_FEATURES_OK == 0 {
                    let shift = match self.driver_features_select {
                        0 => 0,
                        1 => 32,
                        _ => return,
                    };
                    self.acked_features = (self.acked_features & !(0xffff_ffff << shift)) | (u64::from(value) << shift);
                }
            }
            REG_QUEUE_SEL => self.queue_select = value,
            REG_QUEUE_NUM => {
                if let Some(q) = self.selected_queue() {
                    q.set_size(u16::try_from(value).unwrap_or(0));
                }
            }
            REG_QUEUE_READY => {
                if let Some(q) = self.selected_queue() {
                    q.set_ready(value == 1);
                }
            }
            REG_QUEUE_NOTIFY => self.notify(value),
            REG_INTERRUPT_ACK => self.interrupt_status &= !value,
            REG_STATUS => self.set_status(value),
            REG_QUEUE_DESC_LOW => {
                self.selected_queue().into_iter().for_each(|q| q.set_desc_table_address(Some(value), None))
            }
            REG_QUEUE_DESC_HIGH => {
                self.selected_queue().into_iter().for_each(|q| q.set_desc_table_address(None, Some(value)))
            }
            REG_QUEUE_DRIVER_LOW => {
                self.selected_queue().into_iter().for_each(|q| q.set_avail_ring_address(Some(value), None))
            }
            REG_QUEUE_DRIVER_HIGH => {
                self.selected_queue().into_iter().for_each(|q| q.set_avail_ring_address(None, Some(value)))
            }
            REG_QUEUE_DEVICE_LOW => {
                self.selected_queue().into_iter().for_each(|q| q.set_used_ring_address(Some(value), None))
            }
            REG_QUEUE_DEVICE_HIGH => {
                self.selected_queue().into_iter().for_each(|q| q.set_used_ring_address(None, Some(value)))
            }
            _ => tracing::debug!("virtio-mmio: write of {value:#x} to read-only or unknown register {offset:#x}"),
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE {
            self.device.read_config(offset - CONFIG_SPACE, data);
            return;
        }
        if data.len() != 4 {
            data.fill(0);
            return;
        }
        data.copy_from_slice(&self.read_register(offset).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE {
            self.device.write_config(offset - CONFIG_SPACE, data);
            return;
        }
        // Registers are 32 bits wide and accessed as such (§4.2.2.2).
        let Ok(bytes) = <[u8; 4]>::try_from(data) else { return };
        self.write_register(offset, u32::from_le_bytes(bytes));
    }
}
