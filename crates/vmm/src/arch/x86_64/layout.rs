//! The guest's physical memory map: every address, size and interrupt line
//! the guest sees, with why it is where it is.
//!
//! ```text
//! 0x0000_0500  GDT                     (below the real-mode BIOS data area users)
//! 0x0000_0520  IDT                     (empty: the kernel installs its own)
//! 0x0000_6000  PVH start_info + memory map
//! 0x0000_7000  zero page (struct boot_params)
//! 0x0000_8ff0  boot stack (grows down)
//! 0x0000_9000  PML4, 0xa000 PDPT, 0xb000 PD: identity map of the first GiB
//! 0x0002_0000  kernel command line
//! 0x0009_fc00  EBDA (not RAM for the guest)
//! 0x000e_0000  ACPI: RSDP, then XSDT, FADT, MADT, DSDT (Linux scans here too)
//! 0x0010_0000  high memory: the kernel loads at its own p_paddr above this
//!   …          RAM; the initramfs at the top of RAM below the MMIO hole
//! 0xc000_0000  MMIO hole (1 GiB): boot timer, virtio-mmio windows,
//!              IOAPIC 0xfec0_0000, LAPIC 0xfee0_0000, KVM's TSS 0xfffb_d000
//! 0x1_0000_0000 RAM beyond 3 GiB continues here
//! ```

/// Global descriptor table: four 8-byte entries (null, code32, code64, data).
pub const GDT_ADDR: u64 = 0x500;
/// An empty IDT; the kernel loads its own before enabling interrupts.
pub const IDT_ADDR: u64 = 0x520;
/// PVH `hvm_start_info`, followed by its memory map table.
pub const PVH_INFO_ADDR: u64 = 0x6000;
/// PVH memory map entries, right after the 56-byte start_info.
pub const PVH_MEMMAP_ADDR: u64 = 0x6040;
/// The Linux zero page (`struct boot_params`), passed in `rsi`.
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Initial stack pointer: below the page tables, above the zero page.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Page-map level 4 of the boot identity mapping.
pub const PML4_ADDR: u64 = 0x9000;
/// Page directory pointer table of the boot identity mapping.
pub const PDPT_ADDR: u64 = 0xa000;
/// Page directory (512 × 2 MiB pages = the first GiB) of the boot mapping.
pub const PD_ADDR: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_ADDR: u64 = 0x2_0000;
/// Longest command line accepted: x86 Linux's `COMMAND_LINE_SIZE`.
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Extended BIOS data area: RAM below it is usable, above it is not.
pub const EBDA_START: u64 = 0x9_fc00;
/// Where the RSDP lives: inside the 0xe0000–0xfffff range Linux scans, and
/// the rest of the ACPI tables after it.
pub const ACPI_START: u64 = 0xe_0000;
/// End (exclusive) of the ACPI tables' area.
pub const ACPI_END: u64 = 0x10_0000;
/// Start of high memory; nothing is loaded below it except boot structures.
pub const HIMEM_START: u64 = 0x10_0000;

/// The MMIO hole below 4 GiB: no RAM is mapped here.
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
/// Size of the MMIO hole (up to 4 GiB).
pub const MMIO_HOLE_SIZE: u64 = 0x4000_0000;
/// Where RAM continues when the guest has more than fits below the hole.
pub const HIGH_RAM_START: u64 = 0x1_0000_0000;

/// The boot timer's MMIO register (see `devices::boot_timer`).
pub const BOOT_TIMER_ADDR: u64 = MMIO_HOLE_START;
/// Size of the boot timer's MMIO window.
pub const BOOT_TIMER_SIZE: u64 = 0x1000;
/// First virtio-mmio window; each device gets the next one.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
/// One virtio-mmio device's window (the register file is 0x100 + config).
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// IOAPIC registers, where KVM's in-kernel IOAPIC answers.
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
/// Local APIC registers (architectural default).
pub const LAPIC_ADDR: u64 = 0xfee0_0000;
/// KVM needs three pages for the TSS on Intel; the customary place, inside
/// the MMIO hole and below the 4 GiB boundary.
pub const KVM_TSS_ADDR: u64 = 0xfffb_d000;

/// 16550 UART (COM1) I/O ports and interrupt.
pub const SERIAL_PORT: u16 = 0x3f8;
/// Number of I/O ports of the 16550.
pub const SERIAL_PORT_LEN: u16 = 8;
/// The legacy IRQ of COM1.
pub const SERIAL_IRQ: u32 = 4;
/// i8042 keyboard controller data port; the command port is `+ 4`.
pub const I8042_PORT: u16 = 0x60;
/// Ports 0x60..=0x64.
pub const I8042_PORT_LEN: u16 = 5;
/// The legacy keyboard IRQ.
pub const I8042_IRQ: u32 = 1;
/// The FADT's sleep control/status register (hardware-reduced ACPI has no
/// PM1 blocks); a free port well away from the legacy ones.
pub const ACPI_SLEEP_PORT: u16 = 0x600;
/// First IOAPIC pin for virtio-mmio devices (0–4 are legacy ISA lines).
pub const VIRTIO_IRQ_START: u32 = 5;
/// Last IOAPIC pin of KVM's 24-pin IOAPIC.
pub const IRQ_MAX: u32 = 23;

/// At most this many vCPUs (APIC ids fit the MADT's 8-bit fields easily).
pub const MAX_VCPUS: u8 = 8;
/// Smallest guest memory a Linux guest with an initramfs boots in.
pub const MIN_MEM_MIB: u32 = 32;
/// Largest guest memory accepted (1 TiB); the host's limits apply anyway.
pub const MAX_MEM_MIB: u32 = 1 << 20;

/// The guest's RAM as (start, size) ranges, split around the MMIO hole.
pub fn ram_ranges(mem_size: u64) -> Vec<(u64, u64)> {
    if mem_size <= MMIO_HOLE_START {
        vec![(0, mem_size)]
    } else {
        vec![(0, MMIO_HOLE_START), (HIGH_RAM_START, mem_size - MMIO_HOLE_START)]
    }
}

/// The MMIO window and interrupt line of the `index`-th virtio-mmio device,
/// or `None` when the IOAPIC has no pin left for it.
pub fn virtio_mmio_slot(index: u32) -> Option<(u64, u32)> {
    let irq = VIRTIO_IRQ_START.checked_add(index)?;
    (irq <= IRQ_MAX).then(|| (VIRTIO_MMIO_START + u64::from(index) * VIRTIO_MMIO_SIZE, irq))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_structures_do_not_overlap() {
        let regions = [
            (GDT_ADDR, 4 * 8),
            (IDT_ADDR, 8),
            (PVH_INFO_ADDR, 56),
            (PVH_MEMMAP_ADDR, ZERO_PAGE_ADDR - PVH_MEMMAP_ADDR),
            (ZERO_PAGE_ADDR, 4096),
            (PML4_ADDR, 4096),
            (PDPT_ADDR, 4096),
            (PD_ADDR, 4096),
            (CMDLINE_ADDR, CMDLINE_MAX_SIZE as u64),
            (ACPI_START, ACPI_END - ACPI_START),
        ];
        for (i, a) in regions.iter().enumerate() {
            for b in &regions[i + 1..] {
                assert!(a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0, "{a:x?} overlaps {b:x?}");
            }
        }
        const { assert!(ZERO_PAGE_ADDR + 4096 <= BOOT_STACK_POINTER) };
        const { assert!(BOOT_STACK_POINTER < PML4_ADDR) };
        assert!(CMDLINE_ADDR + CMDLINE_MAX_SIZE as u64 <= EBDA_START);
        const { assert!(ACPI_END <= HIMEM_START) };
    }

    #[test]
    fn ram_skips_the_mmio_hole() {
        assert_eq!(ram_ranges(512 << 20), vec![(0, 512 << 20)]);
        assert_eq!(ram_ranges(MMIO_HOLE_START), vec![(0, MMIO_HOLE_START)]);
        assert_eq!(ram_ranges(4 << 30), vec![(0, MMIO_HOLE_START), (HIGH_RAM_START, 1 << 30)]);
    }

    #[test]
    fn devices_live_in_the_hole() {
        for addr in [BOOT_TIMER_ADDR, VIRTIO_MMIO_START, IOAPIC_ADDR, LAPIC_ADDR, KVM_TSS_ADDR] {
            assert!((MMIO_HOLE_START..MMIO_HOLE_START + MMIO_HOLE_SIZE).contains(&addr), "{addr:#x}");
        }
        const { assert!(BOOT_TIMER_ADDR + BOOT_TIMER_SIZE <= VIRTIO_MMIO_START) };
    }

    #[test]
    fn virtio_slots_use_free_ioapic_pins() {
        assert_eq!(virtio_mmio_slot(0), Some((VIRTIO_MMIO_START, 5)));
        assert_eq!(virtio_mmio_slot(1), Some((VIRTIO_MMIO_START + 0x1000, 6)));
        assert_eq!(virtio_mmio_slot(18), Some((VIRTIO_MMIO_START + 18 * 0x1000, 23)));
        assert_eq!(virtio_mmio_slot(19), None);
        let (last, _) = virtio_mmio_slot(18).unwrap_or_default();
        assert!(last + VIRTIO_MMIO_SIZE <= IOAPIC_ADDR);
    }
}
