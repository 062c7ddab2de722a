//! moat-vmm's wire types: the configuration file that moat writes and
//! moat-vmm reads ([`config`]), and the JSON-lines requests and answers of
//! its control socket ([`control`]).
//!
//! Both sides build and parse these same types, so that the format cannot
//! drift between them. The crate holds data only: moat-vmm validates a
//! configuration against the host (files, sockets, its own limits) and
//! serves the control socket; moat writes and asks.

pub mod config;
pub mod control;

pub use config::{DiskConfig, NetConfig, VmConfig, VsockConfig};
pub use control::{Reply, Request, Shutdown, State, Status};
