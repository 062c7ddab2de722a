//! moat's minimal rust-vmm microVM monitor.
//!
//! Not built yet: the KVM setup, Linux boot, devices and the vsock muxer
//! arrive with the VMM issues (M5, M6). Until then this crate holds nothing,
//! and `moat-vmm` refuses to start rather than pretend to run a VM.
