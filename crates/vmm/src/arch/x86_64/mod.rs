//! x86_64: the memory map, boot protocol, CPU registers, CPUID and MSRs.

pub mod boot;
pub mod cpuid;
pub mod gdt;
pub mod layout;
pub mod msr;
pub mod regs;
