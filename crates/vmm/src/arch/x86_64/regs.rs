//! Boot-time vCPU state: general and special registers, FPU, the boot GDT and
//! identity page tables in guest memory, and the local APIC's LINT pins.

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_regs, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::gdt::{self, CODE32_SELECTOR, CODE64_SELECTOR, DATA_SELECTOR};
use super::layout::{BOOT_STACK_POINTER, GDT_ADDR, IDT_ADDR, PD_ADDR, PDPT_ADDR, PML4_ADDR};

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
/// Bit 1 of RFLAGS is reserved and always set.
const RFLAGS_RESERVED: u64 = 0x2;
/// Page table entry: present and writable.
const PAGE_PRESENT_RW: u64 = 0x3;
/// Page directory entry: maps a 2 MiB page.
const PAGE_HUGE: u64 = 0x80;

/// How the kernel is entered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryPoint {
    /// Linux's 64-bit boot protocol: long mode, paging on, `rsi` = zero page.
    Linux64 { entry: u64, zero_page: u64 },
    /// Xen's PVH protocol: 32-bit protected mode, paging off, `ebx` = start_info.
    Pvh { entry: u64, start_info: u64 },
}

impl std::fmt::Display for EntryPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Linux64 { entry, zero_page } => write!(f, "64-bit entry {entry:#x}, zero page {zero_page:#x}"),
            Self::Pvh { entry, start_info } => write!(f, "PVH entry {entry:#x}, start_info {start_info:#x}"),
        }
    }
}

/// Why guest memory could not take the boot tables.
#[derive(Debug, thiserror::Error)]
pub enum BootTablesError {
    #[error("Cannot write the boot GDT into guest memory; is the guest memory at least 1 MiB?")]
    Gdt(#[source] vm_memory::GuestMemoryError),
    #[error("Cannot write the boot page tables into guest memory; is the guest memory at least 1 MiB?")]
    PageTables(#[source] vm_memory::GuestMemoryError),
}

/// Writes the GDT, an empty IDT, and page tables identity-mapping the first
/// GiB with 2 MiB pages (enough for the kernel's own early page tables).
pub fn write_boot_tables(mem: &GuestMemoryMmap) -> Result<(), BootTablesError> {
    for (i, entry) in gdt::boot_gdt().iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(GDT_ADDR + 8 * i as u64)).map_err(BootTablesError::Gdt)?;
    }
    mem.write_obj(0u64, GuestAddress(IDT_ADDR)).map_err(BootTablesError::Gdt)?;
    mem.write_obj(PDPT_ADDR | PAGE_PRESENT_RW, GuestAddress(PML4_ADDR)).map_err(BootTablesError::PageTables)?;
    mem.write_obj(PD_ADDR | PAGE_PRESENT_RW, GuestAddress(PDPT_ADDR)).map_err(BootTablesError::PageTables)?;
    for i in 0..512u64 {
        mem.write_obj((i << 21) | PAGE_PRESENT_RW | PAGE_HUGE, GuestAddress(PD_ADDR + i * 8))
            .map_err(BootTablesError::PageTables)?;
    }
    Ok(())
}

/// Special registers for `entry`, starting from the vCPU's reset state.
pub fn boot_sregs(mut sregs: kvm_sregs, entry: EntryPoint) -> kvm_sregs {
    let gdt = gdt::boot_gdt();
    let data = gdt::kvm_segment_from_gdt(gdt[usize::from(DATA_SELECTOR / 8)], DATA_SELECTOR);
    let code_selector = match entry {
        EntryPoint::Linux64 { .. } => CODE64_SELECTOR,
        EntryPoint::Pvh { .. } => CODE32_SELECTOR,
    };
    sregs.cs = gdt::kvm_segment_from_gdt(gdt[usize::from(code_selector / 8)], code_selector);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = gdt::boot_tss();
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = u16::try_from(std::mem::size_of_val(&gdt) - 1).unwrap_or(u16::MAX);
    sregs.idt.base = IDT_ADDR;
    sregs.idt.limit = 7;
    match entry {
        EntryPoint::Linux64 { .. } => {
            sregs.cr3 = PML4_ADDR;
            sregs.cr4 |= X86_CR4_PAE;
            sregs.cr0 |= X86_CR0_PE | X86_CR0_PG | X86_CR0_ET;
            sregs.efer |= EFER_LME | EFER_LMA;
        }
        EntryPoint::Pvh { .. } => {
            sregs.cr0 = (sregs.cr0 | X86_CR0_PE | X86_CR0_ET) & !X86_CR0_PG;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
    }
    sregs
}

/// General registers for `entry`.
pub fn boot_regs(entry: EntryPoint) -> kvm_regs {
    match entry {
        EntryPoint::Linux64 { entry, zero_page } => kvm_regs {
            rflags: RFLAGS_RESERVED,
            rip: entry,
            rsp: BOOT_STACK_POINTER,
            rbp: BOOT_STACK_POINTER,
            rsi: zero_page,
            ..Default::default()
        },
        EntryPoint::Pvh { entry, start_info } => {
            kvm_regs { rflags: RFLAGS_RESERVED, rip: entry, rbx: start_info, ..Default::default() }
        }
    }
}

/// The FPU as after `fninit`, with SSE exceptions masked (MXCSR's reset value).
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu { fcw: 0x37f, mxcsr: 0x1f80, ..Default::default() }
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// LINT0 as ExtINT and LINT1 as NMI, the way firmware leaves them and Linux
/// expects them ("virtual wire" mode).
pub fn set_lint(lapic: &mut kvm_lapic_state) {
    let mut set = |offset: usize, mode: u32| {
        let value = read_lapic_reg(lapic, offset);
        write_lapic_reg(lapic, offset, (value & !0x700) | (mode << 8));
    };
    set(APIC_LVT0, APIC_MODE_EXTINT);
    set(APIC_LVT1, APIC_MODE_NMI);
}

/// A 32-bit register of the LAPIC page.
pub fn read_lapic_reg(lapic: &kvm_lapic_state, offset: usize) -> u32 {
    let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[offset + i].to_ne_bytes()[0]);
    u32::from_le_bytes(bytes)
}

fn write_lapic_reg(lapic: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, byte) in value.to_le_bytes().into_iter().enumerate() {
        lapic.regs[offset + i] = std::ffi::c_char::from_ne_bytes([byte]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::ZERO_PAGE_ADDR;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).expect("a 2 MiB test memory maps")
    }

    #[test]
    fn page_tables_identity_map_the_first_gib() {
        let mem = memory();
        write_boot_tables(&mem).expect("tables fit");
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_ADDR)).expect("readable");
        assert_eq!(pml4, PDPT_ADDR | 3);
        let pdpt: u64 = mem.read_obj(GuestAddress(PDPT_ADDR)).expect("readable");
        assert_eq!(pdpt, PD_ADDR | 3);
        for i in [0u64, 1, 511] {
            let pde: u64 = mem.read_obj(GuestAddress(PD_ADDR + i * 8)).expect("readable");
            assert_eq!(pde, (i << 21) | 0x83, "entry {i}");
        }
        let code64: u64 = mem.read_obj(GuestAddress(GDT_ADDR + 0x10)).expect("readable");
        assert_eq!(code64, 0x00af_9b00_0000_ffff);
    }

    #[test]
    fn long_mode_entry_has_paging_and_a_64_bit_cs() {
        let entry = EntryPoint::Linux64 { entry: 0x100_0000, zero_page: ZERO_PAGE_ADDR };
        let sregs = boot_sregs(kvm_sregs::default(), entry);
        assert_eq!(sregs.cs.selector, CODE64_SELECTOR);
        assert_eq!(sregs.cs.l, 1);
        assert_eq!(sregs.ds.selector, DATA_SELECTOR);
        assert_eq!(sregs.cr3, PML4_ADDR);
        assert_ne!(sregs.cr0 & X86_CR0_PG, 0);
        assert_ne!(sregs.cr4 & X86_CR4_PAE, 0);
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(sregs.gdt.limit, 31);
        let regs = boot_regs(entry);
        assert_eq!((regs.rip, regs.rsi, regs.rsp, regs.rflags), (0x100_0000, ZERO_PAGE_ADDR, BOOT_STACK_POINTER, 2));
    }

    #[test]
    fn pvh_entry_is_flat_protected_mode_without_paging() {
        let entry = EntryPoint::Pvh { entry: 0x100_0100, start_info: 0x6000 };
        let reset = kvm_sregs { cr0: 0x6000_0010, cr4: X86_CR4_PAE, ..Default::default() };
        let sregs = boot_sregs(reset, entry);
        assert_eq!(sregs.cs.selector, CODE32_SELECTOR);
        assert_eq!((sregs.cs.l, sregs.cs.db), (0, 1));
        assert_eq!(sregs.cr0 & (X86_CR0_PE | X86_CR0_PG), X86_CR0_PE);
        assert_eq!((sregs.cr4, sregs.efer), (0, 0));
        let regs = boot_regs(entry);
        assert_eq!((regs.rip, regs.rbx), (0x100_0100, 0x6000));
    }

    #[test]
    fn lint_pins_are_extint_and_nmi() {
        let mut lapic = kvm_lapic_state::default();
        write_lapic_reg(&mut lapic, APIC_LVT0, 0x0001_0700);
        set_lint(&mut lapic);
        assert_eq!(read_lapic_reg(&lapic, APIC_LVT0), 0x0001_0700);
        assert_eq!(read_lapic_reg(&lapic, APIC_LVT1), 0x400);
    }

    #[test]
    fn fpu_is_reset() {
        let fpu = boot_fpu();
        assert_eq!((fpu.fcw, fpu.mxcsr), (0x37f, 0x1f80));
    }
}
