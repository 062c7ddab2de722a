//! The boot GDT and the KVM segment registers made from it.
//!
//! Both boot protocols need flat segments: the Linux 64-bit entry wants a
//! 64-bit code segment at selector 0x10 and data at 0x18 (`__BOOT_CS`,
//! `__BOOT_DS`); PVH enters in 32-bit protected mode and wants a flat 32-bit
//! code segment. The table holds both: null, code32 (0x08), code64 (0x10),
//! data (0x18).

use kvm_bindings::kvm_segment;

/// Selector of the flat 32-bit code segment (PVH entry).
pub const CODE32_SELECTOR: u16 = 0x08;
/// Selector of the 64-bit code segment (`__BOOT_CS`).
pub const CODE64_SELECTOR: u16 = 0x10;
/// Selector of the flat data segment (`__BOOT_DS`).
pub const DATA_SELECTOR: u16 = 0x18;

/// Flags (bits 8–15 access byte, 20–23 flags nibble) of each descriptor.
const CODE32_FLAGS: u16 = 0xc09b; // G, D/B; present, DPL 0, code, execute/read, accessed
const CODE64_FLAGS: u16 = 0xa09b; // G, L; present, DPL 0, code, execute/read, accessed
const DATA_FLAGS: u16 = 0xc093; // G, B; present, DPL 0, data, read/write, accessed

/// The boot GDT's entries, indexed by selector / 8.
pub fn boot_gdt() -> [u64; 4] {
    [0, gdt_entry(CODE32_FLAGS, 0, 0xfffff), gdt_entry(CODE64_FLAGS, 0, 0xfffff), gdt_entry(DATA_FLAGS, 0, 0xfffff)]
}

/// Packs a segment descriptor (Intel SDM vol. 3, 3.4.5).
pub fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = u64::from(base);
    let limit = u64::from(limit);
    let flags = u64::from(flags);
    ((base & 0xff00_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0x0000_ffff)
        | ((limit & 0x000f_0000) << 32)
        | ((flags & 0xf0ff) << 40)
}

/// The KVM view of descriptor `entry` loaded through selector `selector`.
pub fn kvm_segment_from_gdt(entry: u64, selector: u16) -> kvm_segment {
    let bits = |shift: u32, width: u32| (entry >> shift) & ((1u64 << width) - 1);
    let base = bits(16, 24) | (bits(56, 8) << 24);
    let limit = bits(0, 16) | (bits(48, 4) << 16);
    let g = bits(55, 1);
    // The granularity bit scales the limit to 4 KiB pages; KVM wants bytes.
    let limit = if g == 1 { (limit << 12) | 0xfff } else { limit };
    let narrow = |v: u64| u8::try_from(v).unwrap_or(u8::MAX);
    kvm_segment {
        base,
        limit: u32::try_from(limit).unwrap_or(u32::MAX),
        selector,
        type_: narrow(bits(40, 4)),
        present: narrow(bits(47, 1)),
        dpl: narrow(bits(45, 2)),
        db: narrow(bits(54, 1)),
        s: narrow(bits(44, 1)),
        l: narrow(bits(53, 1)),
        g: narrow(g),
        avl: narrow(bits(52, 1)),
        unusable: u8::from(bits(47, 1) == 0),
        padding: 0,
    }
}

/// A 64-bit TSS descriptor's KVM segment: no TSS is used at boot, but VMX
/// insists on a usable busy TSS in the task register.
pub fn boot_tss() -> kvm_segment {
    kvm_segment { base: 0, limit: 0xfffff, selector: 0, type_: 0xb, present: 1, s: 0, g: 1, ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_encode_flat_segments() {
        let gdt = boot_gdt();
        assert_eq!(gdt[0], 0);
        // The values every x86 boot loader writes for these descriptors.
        assert_eq!(gdt[1], 0x00cf_9b00_0000_ffff);
        assert_eq!(gdt[2], 0x00af_9b00_0000_ffff);
        assert_eq!(gdt[3], 0x00cf_9300_0000_ffff);
    }

    #[test]
    fn segments_decode_what_was_encoded() {
        let gdt = boot_gdt();
        let code64 = kvm_segment_from_gdt(gdt[usize::from(CODE64_SELECTOR / 8)], CODE64_SELECTOR);
        assert_eq!((code64.base, code64.limit, code64.selector), (0, 0xffff_ffff, 0x10));
        assert_eq!((code64.l, code64.db, code64.g, code64.present, code64.s), (1, 0, 1, 1, 1));
        assert_eq!(code64.type_, 0xb);
        let code32 = kvm_segment_from_gdt(gdt[usize::from(CODE32_SELECTOR / 8)], CODE32_SELECTOR);
        assert_eq!((code32.l, code32.db), (0, 1));
        let data = kvm_segment_from_gdt(gdt[usize::from(DATA_SELECTOR / 8)], DATA_SELECTOR);
        assert_eq!((data.type_, data.db, data.unusable), (0x3, 1, 0));
        let null = kvm_segment_from_gdt(0, 0);
        assert_eq!(null.unusable, 1);
    }

    #[test]
    fn base_and_limit_round_trip() {
        let entry = gdt_entry(0x0093, 0x1234_5678, 0xabcde);
        let seg = kvm_segment_from_gdt(entry, 0);
        assert_eq!((seg.base, seg.limit, seg.g), (0x1234_5678, 0xabcde, 0));
    }
}
