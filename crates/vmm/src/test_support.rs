//! Helpers shared by unit tests.

use std::path::PathBuf;

/// A file of the default image, or `None` (with a note) when it is absent.
pub fn default_image_file(name: &str) -> Option<PathBuf> {
    let data = std::env::var_os("MOAT_DATA_DIR").map(PathBuf::from).or_else(|| {
        std::env::var_os("XDG_DATA_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
            .map(|d| d.join("moat"))
    })?;
    let path = data.join("images/default").join(name);
    if path.exists() {
        Some(path)
    } else {
        eprintln!("skipping: {} is absent (cargo xtask image builds it)", path.display());
        None
    }
}
