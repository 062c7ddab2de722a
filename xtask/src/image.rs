//! `cargo xtask image`: the image built (or verified) around the static
//! agent built from this checkout.

use std::path::PathBuf;

use anyhow::Result;

use crate::build;

pub fn build(name: &str, force: bool) -> Result<PathBuf> {
    let agent = build::static_agent()?;
    Ok(moat_image::build(name, force, &agent)?)
}
