//! Architecture-specific machine setup. moat runs on x86_64 only.

pub mod x86_64;
