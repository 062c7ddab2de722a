//! The moat guest agent: the daemon inside every sandbox.
//!
//! It serves the [`moat_proto`] wire protocol, one operation per connection,
//! on a Unix socket (jail) or a vsock port (microVM): processes with
//! streamed stdio, signals, PTYs and timeouts ([`exec`]); file operations
//! ([`files`]); tar streams of trees ([`tarball`]); port forwards
//! ([`forward`]); the egress proxy of `filtered` sandboxes ([`egress`]).
//! As PID 1 it also sets up the machine and reaps every
//! orphan ([`init`], [`reaper`]); in a microVM it boots from the initramfs
//! ([`boot`]) and configures the network device of an `open` sandbox
//! ([`netconf`]).
//!
//! The binary is `bins/moat-agent`; it is linked statically so that it runs
//! in any image, including a bare initramfs.

pub mod boot;
pub mod capabilities;
pub mod cgroup;
pub mod cgroup_sweep;
pub mod egress;
pub mod error;
pub mod exec;
pub mod files;
pub mod forward;
pub mod info;
pub mod init;
pub mod jail;
pub mod keeper;
pub mod launcher;
pub mod netconf;
pub use moat_sys::pidfd;
pub mod reaper;
pub mod seccomp;
pub mod server;
pub mod spawn;
pub mod tarball;
pub mod userns_holder;
pub mod users;

pub use server::{Agent, DEFAULT_VSOCK_PORT, ListenAddr, Listener};
