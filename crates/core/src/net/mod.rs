//! The host side of sandbox networking: the egress proxy of network
//! `filtered` ([`egress`]), preview links into a sandbox ([`preview`]), and
//! the places of listeners that strangers may reach ([`places`]).

pub mod egress;
pub mod gitssh;
pub mod places;
pub mod preview;
