//! The host side of sandbox networking: the egress proxy of network
//! `filtered` ([`egress`]) and preview links into a sandbox ([`preview`]).

pub mod egress;
pub mod gitssh;
pub mod preview;
