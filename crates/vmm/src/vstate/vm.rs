//! The KVM VM: its file descriptor, in-kernel interrupt controllers and PIT,
//! and the guest memory registered with it.

use std::sync::Arc;

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region};
pub use kvm_ioctls::Kvm;
use kvm_ioctls::{VcpuFd, VmFd};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::layout::KVM_TSS_ADDR;

/// Why the VM could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("Cannot open /dev/kvm; is KVM enabled on this host and may this user open it (group kvm)?")]
    OpenKvm(#[source] kvm_ioctls::Error),
    #[error("/dev/kvm speaks API version {0}, not 12; this kernel's KVM is too old or too new")]
    ApiVersion(i32),
    #[error("Cannot create a KVM VM; the host may be out of memory or KVM may be busy")]
    CreateVm(#[source] kvm_ioctls::Error),
    #[error("Cannot set the VM's TSS address")]
    Tss(#[source] kvm_ioctls::Error),
    #[error("Cannot create the in-kernel interrupt controllers (IOAPIC, PIC, local APICs)")]
    IrqChip(#[source] kvm_ioctls::Error),
    #[error("Cannot create the in-kernel PIT")]
    Pit(#[source] kvm_ioctls::Error),
    #[error("Cannot register guest memory region {slot} with KVM")]
    Memory { slot: u32, source: kvm_ioctls::Error },
    #[error("Cannot connect an interrupt eventfd to IOAPIC pin {gsi}")]
    Irqfd { gsi: u32, source: kvm_ioctls::Error },
    #[error("Cannot read the CPUID features KVM supports")]
    Cpuid(#[source] kvm_ioctls::Error),
    #[error("Cannot read the MSRs KVM supports")]
    MsrList(#[source] kvm_ioctls::Error),
    #[error("Cannot create vCPU {index}")]
    CreateVcpu { index: u8, source: kvm_ioctls::Error },
}

/// Opens `/dev/kvm`.
pub fn open_kvm() -> Result<Kvm, VmError> {
    Kvm::new().map_err(VmError::OpenKvm)
}

/// A KVM VM with its guest memory.
#[derive(Debug)]
pub struct Vm {
    kvm: Kvm,
    // Declared before `memory`: the VM must go before the memory it maps.
    fd: VmFd,
    memory: Arc<GuestMemoryMmap>,
}

impl Vm {
    /// Creates the VM, its in-kernel irqchip and PIT, and maps `memory` into it.
    pub fn new(memory: GuestMemoryMmap) -> Result<Self, VmError> {
        Self::with_kvm(open_kvm()?, memory)
    }

    /// As [`Vm::new`], on a `/dev/kvm` opened already (a jailed VMM has no
    /// `/dev`: it opens KVM before entering the jail).
    pub fn with_kvm(kvm: Kvm, memory: GuestMemoryMmap) -> Result<Self, VmError> {
        let version = kvm.get_api_version();
        if version != 12 {
            return Err(VmError::ApiVersion(version));
        }
        let fd = kvm.create_vm().map_err(VmError::CreateVm)?;
        fd.set_tss_address(usize::try_from(KVM_TSS_ADDR).unwrap_or_default()).map_err(VmError::Tss)?;
        fd.create_irq_chip().map_err(VmError::IrqChip)?;
        // The speaker port (0x61) is answered in the kernel too, so the
        // guest's PIT calibration does not exit to the VMM.
        fd.create_pit2(kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() }).map_err(VmError::Pit)?;
        for (slot, region) in memory.iter().enumerate() {
            let slot = u32::try_from(slot).unwrap_or(u32::MAX);
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .map_err(|_| VmError::Memory { slot, source: kvm_ioctls::Error::new(libc::EFAULT) })?;
            let region = kvm_userspace_memory_region {
                slot,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: host as u64,
                flags: 0,
            };
            // SAFETY: the region is a live mapping of `memory_size` bytes owned
            // by `memory`, which this `Vm` (and every vCPU, through the `Arc`)
            // keeps alive for as long as KVM can touch it; slots are distinct.
            unsafe { fd.set_user_memory_region(region) }.map_err(|source| VmError::Memory { slot, source })?;
        }
        Ok(Self { kvm, fd, memory: Arc::new(memory) })
    }

    /// The guest memory.
    pub fn memory(&self) -> &Arc<GuestMemoryMmap> {
        &self.memory
    }

    /// The VM's file descriptor.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// Connects `evt` to IOAPIC pin `gsi`: each write to it is an edge.
    pub fn register_irq(&self, evt: &EventFd, gsi: u32) -> Result<(), VmError> {
        self.fd.register_irqfd(evt, gsi).map_err(|source| VmError::Irqfd { gsi, source })
    }

    /// The CPUID KVM can virtualize on this host.
    pub fn supported_cpuid(&self) -> Result<CpuId, VmError> {
        self.kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(VmError::Cpuid)
    }

    /// The MSRs KVM can save and restore on this host.
    pub fn msr_index_list(&self) -> Result<Vec<u32>, VmError> {
        Ok(self.kvm.get_msr_index_list().map_err(VmError::MsrList)?.as_slice().to_vec())
    }

    /// Creates vCPU `index` (its APIC id).
    pub fn create_vcpu(&self, index: u8) -> Result<VcpuFd, VmError> {
        self.fd.create_vcpu(u64::from(index)).map_err(|source| VmError::CreateVcpu { index, source })
    }
}
