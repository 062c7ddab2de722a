//! CPUID as the guest sees it: KVM's supported set, normalized per vCPU.
//!
//! `KVM_GET_SUPPORTED_CPUID` already drops what KVM cannot virtualize; on top
//! of it each vCPU gets its APIC id and a topology of one socket with
//! `vcpus` single-threaded cores, the hypervisor bit, and no features this
//! VMM does not back (nested virtualization, MONITOR/MWAIT, the PMU).

use kvm_bindings::kvm_cpuid_entry2;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE: u32 = 0x4;
const LEAF_POWER: u32 = 0x6;
const LEAF_PMU: u32 = 0xa;
const LEAF_TOPOLOGY: u32 = 0xb;
const LEAF_TOPOLOGY_V2: u32 = 0x1f;
const LEAF_EXT_FEATURES: u32 = 0x8000_0001;
const LEAF_EXT_SIZES: u32 = 0x8000_0008;
const LEAF_EXT_APIC_ID: u32 = 0x8000_001e;

/// Leaf 1 ECX.
const ECX_MONITOR: u32 = 1 << 3;
const ECX_VMX: u32 = 1 << 5;
const ECX_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 EDX: more than one logical processor per package.
const EDX_HTT: u32 = 1 << 28;
/// Leaf 6 ECX: energy/performance bias, an MSR KVM does not emulate.
const ECX_EPB: u32 = 1 << 3;
/// Leaf 0x8000_0001 ECX.
const ECX_SVM: u32 = 1 << 2;
/// Topology level types in leaf 0xb/0x1f ECX[15:8].
const LEVEL_SMT: u32 = 1;
const LEVEL_CORE: u32 = 2;

/// Rewrites KVM's supported CPUID `entries` for vCPU `index` of `count`.
pub fn normalize(entries: &mut [kvm_cpuid_entry2], index: u8, count: u8) {
    let apic_id = u32::from(index);
    let count = u32::from(count.max(1));
    // Bits needed to number `count` cores: the x2APIC id shift of the core level.
    let core_bits = u32::BITS - (count - 1).leading_zeros();
    for entry in entries.iter_mut() {
        match entry.function {
            LEAF_FEATURES => {
                // EBX: [31:24] initial APIC id, [23:16] logical processors per package.
                entry.ebx = (entry.ebx & 0x0000_ffff) | (apic_id << 24) | (count << 16);
                entry.ecx = (entry.ecx | ECX_HYPERVISOR) & !(ECX_VMX | ECX_MONITOR);
                if count > 1 {
                    entry.edx |= EDX_HTT;
                } else {
                    entry.edx &= !EDX_HTT;
                }
            }
            LEAF_CACHE => {
                // EAX[31:26]: cores per package - 1; [25:14]: threads sharing
                // this cache - 1 (the L3 is shared by all cores, L1/L2 by one).
                let level = (entry.eax >> 5) & 0x7;
                let sharing = if level >= 3 { count - 1 } else { 0 };
                entry.eax = (entry.eax & 0x3fff) | ((count - 1) << 26) | (sharing << 14);
            }
            LEAF_POWER => entry.ecx &= !ECX_EPB,
            LEAF_PMU => {
                entry.eax = 0;
                entry.ebx = 0;
                entry.ecx = 0;
                entry.edx = 0;
            }
            LEAF_TOPOLOGY | LEAF_TOPOLOGY_V2 => {
                entry.edx = apic_id;
                match entry.index {
                    0 => {
                        entry.eax = 0;
                        entry.ebx = 1;
                        entry.ecx = (LEVEL_SMT << 8) | entry.index;
                    }
                    1 => {
                        entry.eax = core_bits;
                        entry.ebx = count;
                        entry.ecx = (LEVEL_CORE << 8) | entry.index;
                    }
                    _ => {
                        entry.eax = 0;
                        entry.ebx = 0;
                        entry.ecx = entry.index;
                    }
                }
            }
            LEAF_EXT_FEATURES => entry.ecx &= !ECX_SVM,
            LEAF_EXT_SIZES => {
                // ECX[7:0]: cores - 1; [15:12]: APIC id bits for them.
                entry.ecx = (entry.ecx & !0xf0ff) | (core_bits << 12) | (count - 1);
            }
            LEAF_EXT_APIC_ID => {
                entry.eax = apic_id;
                entry.ebx = apic_id & 0xff; // one thread per core; core id = APIC id
                entry.ecx = 0; // one node
            }
            _ => {}
        }
    }
}

/// The entry for `function`/`index`, if present.
pub fn find(entries: &[kvm_cpuid_entry2], function: u32, index: u32) -> Option<&kvm_cpuid_entry2> {
    entries.iter().find(|e| e.function == function && e.index == index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 { function, index, eax, ebx, ecx, edx, ..Default::default() }
    }

    fn sample() -> Vec<kvm_cpuid_entry2> {
        vec![
            entry(0, 0, 0x1f, 0, 0, 0),
            entry(1, 0, 0x806f8, 0x0010_0800, ECX_VMX | ECX_MONITOR | 1, 0),
            entry(4, 0, (1 << 5) | 0x1, 0, 0, 0),
            entry(4, 3, (3 << 5) | 0x3, 0, 0, 0),
            entry(6, 0, 0x4, 0, ECX_EPB | 1, 0),
            entry(0xa, 0, 0x0703_0105, 1, 2, 3),
            entry(0xb, 0, 1, 2, 0x100, 7),
            entry(0xb, 1, 4, 16, 0x201, 7),
            entry(0xb, 2, 0, 0, 2, 7),
            entry(0x8000_0001, 0, 0, 0, ECX_SVM | 1, 0),
            entry(0x8000_0008, 0, 0x3030, 0, 0x700f, 0),
        ]
    }

    #[test]
    fn leaf_1_carries_the_apic_id_and_hypervisor_bit() {
        let mut entries = sample();
        normalize(&mut entries, 3, 4);
        let leaf1 = find(&entries, 1, 0).expect("leaf 1 kept");
        assert_eq!(leaf1.ebx >> 24, 3);
        assert_eq!((leaf1.ebx >> 16) & 0xff, 4);
        assert_eq!(leaf1.ebx & 0xffff, 0x0800, "CLFLUSH size kept");
        assert_ne!(leaf1.ecx & ECX_HYPERVISOR, 0);
        assert_eq!(leaf1.ecx & (ECX_VMX | ECX_MONITOR), 0);
        assert_eq!(leaf1.ecx & 1, 1, "other features kept");
        assert_ne!(leaf1.edx & EDX_HTT, 0);
        let mut single = sample();
        normalize(&mut single, 0, 1);
        assert_eq!(find(&single, 1, 0).map(|e| e.edx & EDX_HTT), Some(0));
    }

    #[test]
    fn topology_is_one_socket_of_single_threaded_cores() {
        let mut entries = sample();
        normalize(&mut entries, 5, 6);
        let smt = find(&entries, 0xb, 0).expect("subleaf 0");
        assert_eq!((smt.eax, smt.ebx, smt.ecx, smt.edx), (0, 1, 0x100, 5));
        let core = find(&entries, 0xb, 1).expect("subleaf 1");
        assert_eq!((core.eax, core.ebx, core.ecx, core.edx), (3, 6, 0x201, 5));
        let end = find(&entries, 0xb, 2).expect("subleaf 2");
        assert_eq!((end.eax, end.ebx, end.ecx), (0, 0, 2));
        let l1 = find(&entries, 4, 0).expect("L1");
        assert_eq!((l1.eax >> 26, (l1.eax >> 14) & 0xfff, l1.eax & 0x3fff), (5, 0, 0x21));
        let l3 = find(&entries, 4, 3).expect("L3");
        assert_eq!((l3.eax >> 26, (l3.eax >> 14) & 0xfff), (5, 5));
        let sizes = find(&entries, 0x8000_0008, 0).expect("sizes");
        assert_eq!((sizes.ecx & 0xff, (sizes.ecx >> 12) & 0xf), (5, 3));
    }

    #[test]
    fn unbacked_features_are_masked() {
        let mut entries = sample();
        normalize(&mut entries, 0, 1);
        assert_eq!(find(&entries, 0x8000_0001, 0).map(|e| e.ecx), Some(1));
        assert_eq!(find(&entries, 6, 0).map(|e| e.ecx), Some(1));
        let pmu = find(&entries, 0xa, 0).expect("leaf 0xa");
        assert_eq!((pmu.eax, pmu.ebx, pmu.ecx, pmu.edx), (0, 0, 0, 0));
        let core = find(&entries, 0xb, 1).expect("subleaf 1");
        assert_eq!((core.eax, core.ebx), (0, 1));
    }
}
