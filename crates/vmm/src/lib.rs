//! moat's minimal rust-vmm microVM monitor: one process per microVM.
//!
//! The tree follows the machine: `arch` (memory map, boot protocol, CPU
//! state), `vstate` (the KVM VM, guest memory, vCPU threads), `devices`
//! (buses, serial, i8042, boot timer, ACPI), `builder` (configuration →
//! running VM), `vmm` (the event loop), `control` (the JSON-lines control
//! socket), `seccomp` (the per-thread filters) and `jail` (the namespaces,
//! file system and privileges of a jailed VMM), `log_budget` (log lines
//! a guest can cause, rationed). See `docs/vmm.md`.

pub mod arch;
pub mod builder;
pub mod config;
pub mod control;
pub mod devices;
pub mod jail;
pub mod log_budget;
pub mod seccomp;
pub mod vmm;
pub mod vstate;

pub use vstate::vcpu::VmExit;

#[cfg(test)]
pub(crate) mod test_support;
