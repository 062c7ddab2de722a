//! Where core finds the host programs it runs (pasta, passt, mkfs.ext4,
//! moat-vmm).

use std::path::PathBuf;

/// The program `name` in a directory of `PATH`, else in `/usr/bin` or
/// `/usr/sbin` (where Debian installs passt and pasta; a service's `PATH`
/// may be minimal).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin".into(), "/usr/sbin".into()])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}
