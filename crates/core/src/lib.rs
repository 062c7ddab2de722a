//! moat's sandbox and task model, and its isolation backends.
//!
//! So far this crate knows how to choose a backend for this host
//! ([`backend`]) and how to find and check a built image ([`image`]); the sandbox model and the jail backend arrive with M3, the
//! vm backend with M8.

pub mod backend;
pub mod image;

pub use backend::{BackendChoice, BackendKind, HostVirtualization};
pub use image::{Image, ImageError, Manifest};
