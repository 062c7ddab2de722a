//! Emulated devices and the buses the vCPUs dispatch port I/O and MMIO on.

pub mod acpi;
pub mod boot_timer;
pub mod bus;
pub mod legacy;
pub mod virtio;

use vmm_sys_util::eventfd::EventFd;

/// An interrupt line: an eventfd registered with KVM as an irqfd, so a write
/// raises the IOAPIC pin without a trip through the VMM.
#[derive(Debug)]
pub struct IrqLine(pub EventFd);

impl vm_superio::Trigger for IrqLine {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// An event the VMM loop waits on (guest reset, a vCPU's exit).
#[derive(Debug)]
pub struct EventTrigger(pub EventFd);

impl vm_superio::Trigger for EventTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}
