//! KVM state: the VM, its guest memory, and its vCPUs.

pub mod memory;
pub mod vcpu;
pub mod vm;
