//! Linux primitives that moat's host side (`moat-core`) and its agent
//! (`moat-agent`, which is also a jail's monitor) both need, kept here so
//! that the two cannot drift apart and neither depends on the other.
//!
//! - [`pidfd`]: processes waited for and killed through pidfds.
//! - [`beneath`]: directories and files made beneath a root held by
//!   descriptor, following no symlink (a jail's mount points in a root
//!   built over an image moat does not trust).
//! - [`cgroupfs`]: a cgroup tree thawed, counted and removed through
//!   directory descriptors, at any depth.
//! - [`fds`]: descriptors inherited from whatever started a moat process,
//!   kept from the programs it starts.
//! - [`idmap`]: an image's tree mounted with its owners moved into a
//!   jail's id range, and whether this host can.

pub mod beneath;
pub mod cgroupfs;
pub mod fds;
pub mod idmap;
pub mod pidfd;
