//! Model-specific registers set at boot.
//!
//! The values a freshly reset CPU (or firmware) leaves, which Linux relies
//! on: SYSCALL/SYSENTER MSRs cleared, fast strings enabled, and the MTRRs
//! enabled with write-back as the default memory type (without it the
//! kernel maps all RAM uncached and boots very slowly).

use kvm_bindings::kvm_msr_entry;

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

const MISC_ENABLE_FAST_STRING: u64 = 1;
const MTRR_ENABLE: u64 = 1 << 11;
const MTRR_TYPE_WRITE_BACK: u64 = 6;

/// The boot MSRs, restricted to those in `supported` (KVM's MSR index list),
/// so that a host lacking one does not fail the boot.
pub fn boot_msrs(supported: &[u32]) -> Vec<kvm_msr_entry> {
    [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE | MTRR_TYPE_WRITE_BACK),
    ]
    .into_iter()
    .filter(|(index, _)| supported.contains(index))
    .map(|(index, data)| kvm_msr_entry { index, data, ..Default::default() })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtrrs_default_to_write_back() {
        let msrs = boot_msrs(&[MSR_MTRR_DEF_TYPE, MSR_IA32_MISC_ENABLE]);
        assert_eq!(msrs.len(), 2);
        assert_eq!(msrs[0].data, 1);
        assert_eq!(msrs[1].data, 0x806);
    }

    #[test]
    fn unsupported_msrs_are_left_out() {
        assert!(boot_msrs(&[]).is_empty());
        assert_eq!(boot_msrs(&[MSR_LSTAR, 0x1234]).len(), 1);
    }
}
